"""Calls CUDA runtime functions of a libcudart.so.12 or .so.13 (argv[1]) through ctypes on command, for
tests/test_cudart.py; with a libcuda.so.1 (argv[2], optional) also the driver's cuStreamSynchronize directly.

stdin lines: "memcpy BYTES KIND", "memcpyasync BYTES KIND", "malloc BYTES", "sync", "driver-sync" -> prints
the call's result code. Copies pass one host buffer for both pointers: the stand-in ignores them, the real
runtime fails (no GPU) before using them.
"""
import ctypes
import sys


def main() -> None:
    rt = ctypes.CDLL(sys.argv[1])
    driver = ctypes.CDLL(sys.argv[2]) if len(sys.argv) > 2 else None
    buf = ctypes.create_string_buffer(1 << 16)
    ptr = ctypes.c_void_p()
    calls = {
        "memcpy": lambda n, kind: rt.cudaMemcpy(buf, buf, ctypes.c_size_t(int(n)), int(kind)),
        "memcpyasync": lambda n, kind: rt.cudaMemcpyAsync(buf, buf, ctypes.c_size_t(int(n)), int(kind), None),
        "malloc": lambda n: rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(int(n))),
        "sync": lambda: rt.cudaStreamSynchronize(None),
        "driver-sync": lambda: driver.cuStreamSynchronize(None),
    }
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        print(calls[cmd](*args), flush=True)


if __name__ == "__main__":
    main()
