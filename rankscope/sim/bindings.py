"""ctypes bindings of the stand-in libcuda.so.1 / libnccl.so.2, with their real C signatures.

Loading them maps the libraries into the process (so a process that imports this and calls `load` looks like
a training process to node-wide discovery: the launcher never does). No package-relative imports: rank.py
may run as a plain script under another interpreter.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p
from pathlib import Path

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INTERRUPTED = 999  # CUDA_ERROR_UNKNOWN: a wait cut short by a signal (rsim_set_interruptible)
NCCL_SYSTEM_ERROR = 2

# ncclDataType_t
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
# ncclRedOp_t
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)


class CUlaunchConfig(Structure):
    _fields_ = [
        ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
        ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint),
        ("hStream", c_void_p),
        ("attrs", c_void_p),
        ("numAttrs", c_uint),
    ]


class NcclUniqueId(Structure):
    _fields_ = [("internal", c_char * 128)]


class CudaError(RuntimeError):
    def __init__(self, func: str, code: int):
        super().__init__(f"{func} failed: CUresult {code}")
        self.func, self.code = func, code


class NcclError(RuntimeError):
    def __init__(self, func: str, code: int):
        super().__init__(f"{func} failed: ncclResult_t {code}")
        self.func, self.code = func, code


def _check_cuda(result, func, _args):
    if result != CUDA_SUCCESS:
        raise CudaError(func.__name__, result)
    return result


def _check_nccl(result, func, _args):
    if result != 0:
        raise NcclError(func.__name__, result)
    return result


_CUDA = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [POINTER(c_int)],
    "cuDeviceGetCount": [POINTER(c_int)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuCtxCreate_v2": [POINTER(c_void_p), c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuCtxSynchronize": [],
    "cuStreamCreate": [POINTER(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamSynchronize_ptsz": [c_void_p],
    "cuModuleLoadData": [POINTER(c_void_p), c_void_p],
    "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuFuncGetName": [POINTER(c_char_p), c_void_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p, c_void_p],
    "cuLaunchKernel_ptsz": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p,
                            c_void_p],
    "cuLaunchKernelEx": [POINTER(CUlaunchConfig), c_void_p, c_void_p, c_void_p],
    "cuLaunchKernelEx_ptsz": [POINTER(CUlaunchConfig), c_void_p, c_void_p, c_void_p],
    "cuMemAlloc_v2": [POINTER(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuMemcpyHtoDAsync_v2": [c_uint64, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2": [c_void_p, c_uint64, c_size_t, c_void_p],
    "cuMemcpyHtoDAsync_v2_ptsz": [c_uint64, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2_ptsz": [c_void_p, c_uint64, c_size_t, c_void_p],
    "cuEventCreate": [POINTER(c_void_p), c_uint],
    "cuEventDestroy_v2": [c_void_p],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventRecord_ptsz": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventElapsedTime": [POINTER(c_float), c_void_p, c_void_p],
}
_CUDA_QUERIES = {"cuStreamQuery": [c_void_p], "cuEventQuery": [c_void_p]}  # NOT_READY is an answer

_NCCL = {
    "ncclGetVersion": [POINTER(c_int)],
    "ncclGetUniqueId": [POINTER(NcclUniqueId)],
    "ncclCommInitRank": [POINTER(c_void_p), c_int, NcclUniqueId, c_int],
    "ncclCommDestroy": [c_void_p],
    "ncclCommCount": [c_void_p, POINTER(c_int)],
    "ncclCommUserRank": [c_void_p, POINTER(c_int)],
    "ncclAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
    "ncclAllGather": [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p],
    "ncclReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
    "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
    "ncclReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_void_p, c_void_p],
    "ncclSend": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
    "ncclRecv": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
}


def load(lib_dir: str | Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """Loads libcuda.so.1 then libnccl.so.2 from `lib_dir` by absolute path; returns (cuda, nccl)."""
    lib_dir = Path(lib_dir).resolve()
    cuda = ctypes.CDLL(str(lib_dir / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    nccl = ctypes.CDLL(str(lib_dir / "libnccl.so.2"), mode=ctypes.RTLD_GLOBAL)
    for name, argtypes in _CUDA.items():
        f = getattr(cuda, name)
        f.argtypes, f.restype, f.errcheck = argtypes, c_int, _check_cuda
    for name, argtypes in _CUDA_QUERIES.items():
        f = getattr(cuda, name)
        f.argtypes, f.restype = argtypes, c_int
    for name, argtypes in _NCCL.items():
        f = getattr(nccl, name)
        f.argtypes, f.restype, f.errcheck = argtypes, c_int, _check_nccl
    nccl.ncclGetErrorString.argtypes, nccl.ncclGetErrorString.restype = [c_int], c_char_p
    cuda.rsim_set_gpu_factor.argtypes, cuda.rsim_set_gpu_factor.restype = [c_double], None
    cuda.rsim_get_gpu_factor.argtypes, cuda.rsim_get_gpu_factor.restype = [], c_double
    cuda.rsim_set_interruptible.argtypes, cuda.rsim_set_interruptible.restype = [c_int], None
    cuda.rsim_set_interrupt_fd.argtypes, cuda.rsim_set_interrupt_fd.restype = [c_int], None
    cuda.rsim_interrupt_pending.argtypes, cuda.rsim_interrupt_pending.restype = [], c_int
    cuda.rsim_now_ns.argtypes, cuda.rsim_now_ns.restype = [], ctypes.c_int64
    nccl.rsim_set_link_factor.argtypes, nccl.rsim_set_link_factor.restype = [c_double], None
    nccl.rsim_get_link_factor.argtypes, nccl.rsim_get_link_factor.restype = [], c_double
    nccl.rsim_comm_shm_name.argtypes, nccl.rsim_comm_shm_name.restype = [POINTER(NcclUniqueId), c_char_p, c_int], c_int
    return cuda, nccl


def unique_id_from_bytes(raw: bytes) -> NcclUniqueId:
    if len(raw) != 128:
        raise ValueError(f"an ncclUniqueId is 128 bytes, not {len(raw)}")
    uid = NcclUniqueId()
    ctypes.memmove(ctypes.byref(uid), raw, 128)
    return uid


def unique_id_bytes(uid: NcclUniqueId) -> bytes:
    return ctypes.string_at(ctypes.byref(uid), 128)


def shm_name(raw_id: bytes) -> str:
    """The communicator's shared-memory name ("/rankscope-sim-<FNV-1a 64 of the id, hex>"), as libnccl makes it."""
    h = 14695981039346656037
    for b in raw_id:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"/rankscope-sim-{h:016x}"
