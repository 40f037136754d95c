"""Helpers shared by the tests: processes and files (procs), the transport battery (conformance),
the collective cases and NumPy references (cases), and the torch workers (torch_workers).
"""
