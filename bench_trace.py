"""Summarise a Chrome trace of `bench.py --profile --trace FILE`: GPU kernel time by kind and by name, and
the GPU's idle time before each kernel name.

    python bench_trace.py trace.json.gz
"""

import collections
import gzip
import json
import sys

KERNEL_KINDS = (("flex_attention", "attention"), ("flash", "attention"), ("fmha", "attention"), ("gemm", "matmul"),
                ("nvjet", "matmul"), ("cutlass", "matmul"), ("adam", "optimizer"),
                ("nccl", "collective"), ("triton", "other fused (Inductor)"), ("chunk_cat", "FSDP copy"),
                ("split_with_sizes_copy", "FSDP copy"), ("memcpy", "memcpy / memset"), ("memset", "memcpy / memset"))


def kernel_kind(name: str) -> str:
    """A kernel's kind by name: matmul, attention, fused Inductor code, optimizer, FSDP copy, memcpy, ..."""
    lowered = name.lower()
    return next((kind for key, kind in KERNEL_KINDS if key in lowered), "other")


def read_trace(path: str, top: int = 40) -> None:
    """Print a --trace file's kernel time by kind and name, and the GPU idle time before each kernel name."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu_work = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in gpu_work), key=lambda e: e["ts"])
    if not kernels:
        print(f"{path}: no GPU kernels (a CPU run)")
        return
    busy, idle_before, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    end = kernels[0]["ts"]
    for k in kernels:
        busy[k["name"][:90]] += k["dur"] / 1e3
        by_kind[kernel_kind(k["name"])] += k["dur"] / 1e3
        idle_before[k["name"][:90]] += max(0.0, k["ts"] - end) / 1e3
        end = max(end, k["ts"] + k["dur"])
    print(f"span {(end - kernels[0]['ts']) / 1e3:.1f} ms, kernels {sum(busy.values()):.1f} ms, "
          f"GPU idle {sum(idle_before.values()):.1f} ms")
    for title, table in (("kernel time by kind", by_kind), ("kernel time by name", busy),
                         ("GPU idle just before, by kernel name", idle_before)):
        print(f"\n{title} (ms):")
        for name, ms in table.most_common(top):
            print(f"{ms:9.1f}  {name}")


if __name__ == "__main__":
    read_trace(sys.argv[1])
