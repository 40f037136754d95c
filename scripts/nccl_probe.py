"""Probe the ctypes NCCL binding at world size 1 on the current GPU (device check; not a test)."""
import time
import numpy as np
import torch
from tcoll.comm import nccl_lib

t0 = time.perf_counter()
nc = nccl_lib.Nccl.load()
print("nccl", nc.path, nc.version, f"{time.perf_counter()-t0:.3f}s")
torch.cuda.set_device(0)
uid = nc.unique_id()
comm = nc.init_rank(1, uid, 0)
print("comm", hex(comm), f"{time.perf_counter()-t0:.3f}s")
lib = nc.lib
s = torch.cuda.current_stream().cuda_stream
for dt, code in [(torch.float32, 7), (torch.bfloat16, 9), (torch.int64, 4), (torch.float16, 6)]:
    x = torch.arange(10, device="cuda").to(dt)
    y = torch.empty_like(x)
    for op, oc in nccl_lib.OPS.items():
        if op == "avg" and dt == torch.int64:
            continue
        nc.check(lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), 10, code, oc, comm, s), "ncclAllReduce", comm)
        assert torch.equal(y, x), (dt, op, y)
    nc.check(lib.ncclBroadcast(x.data_ptr(), y.data_ptr(), 10, code, 0, comm, s), "bc", comm)
    nc.check(lib.ncclReduce(x.data_ptr(), y.data_ptr(), 10, code, 0, 0, comm, s), "red", comm)
    nc.check(lib.ncclAllGather(x.data_ptr(), y.data_ptr(), 10, code, comm, s), "ag", comm)
    nc.check(lib.ncclReduceScatter(x.data_ptr(), y.data_ptr(), 10, code, 0, comm, s), "rs", comm)
    nc.check(lib.ncclGroupStart(), "gs")
    nc.check(lib.ncclSend(x.data_ptr(), 10, code, 0, comm, s), "send", comm)
    nc.check(lib.ncclRecv(y.data_ptr(), 10, code, 0, comm, s), "recv", comm)
    nc.check(lib.ncclGroupEnd(), "ge")
    torch.cuda.synchronize()
    assert torch.equal(y, x)
    print("ok", dt)
print("async", nc.async_error(comm))
try:
    nc.check(lib.ncclAllReduce(0, 0, 10, 77, 0, comm, s), "bad dtype", comm)
except nccl_lib.NcclError as e:
    print("expected error:", e)
big = torch.ones(16 << 20, device="cuda")
for _ in range(3):
    nc.check(lib.ncclAllReduce(big.data_ptr(), big.data_ptr(), big.numel(), 7, 0, comm, s), "ar", comm)
torch.cuda.synchronize()
t1 = time.perf_counter()
for _ in range(20):
    nc.check(lib.ncclAllReduce(big.data_ptr(), big.data_ptr(), big.numel(), 7, 0, comm, s), "ar", comm)
torch.cuda.synchronize()
print(f"64MiB allreduce world1 {(time.perf_counter()-t1)/20*1e6:.0f} us")
print("abort", lib.ncclCommAbort(comm))
comm2 = nc.init_rank(1, nc.unique_id(), 0)
print("destroy", lib.ncclCommDestroy(comm2))
print("NCCL PROBE DONE")
