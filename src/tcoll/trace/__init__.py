"""Seeing what runs: pictures of algorithms' schedules (`tcoll trace`, matplotlib) from tcoll.algos.record."""
