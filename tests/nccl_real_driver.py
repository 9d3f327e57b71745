"""Calls the real libnccl.so.2 (argv[1]) through ctypes on command, for tests/test_real_nvidia.py.

No GPU is needed: ncclGetUniqueId succeeds, ncclCommInitRank fails in CUDA set-up and a collective on a NULL
comm fails its argument check, each after the entry of the function (where the probes fire).
stdin: "uid" -> prints the id's 128 bytes in hex; "init NRANKS RANK" / "allreduce COUNT DTYPE OP" -> the result.
"""
import ctypes
import sys


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def main() -> None:
    nccl = ctypes.CDLL(sys.argv[1])
    uid = UniqueId()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "uid":
            rc = nccl.ncclGetUniqueId(ctypes.byref(uid))
            print(rc, ctypes.string_at(ctypes.addressof(uid), 128).hex(), flush=True)  # all 128 bytes, NULs too
        elif cmd == "init":
            comm = ctypes.c_void_p()
            print(nccl.ncclCommInitRank(ctypes.byref(comm), int(args[0]), uid, int(args[1])), flush=True)
        elif cmd == "allreduce":
            count, dtype, op = map(int, args)
            print(nccl.ncclAllReduce(None, None, ctypes.c_size_t(count), dtype, op, None, None), flush=True)


if __name__ == "__main__":
    main()
