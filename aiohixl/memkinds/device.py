"""Device memory (CUDA, Ascend NPU, anything DLPack calls a device): refused, naming the device.

This is where a device kind will go once a transport can reach device memory;
until then every such object gets an UnsupportedMemory that says what it is.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedMemory
from .base import Pinned
from .torch_cpu import is_tensor

# DLPack's DLDeviceType codes (dlpack.h); 1 and 3 are host memory.
_DLPACK_DEVICES = {
    2: "cuda",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    9: "vpi",
    10: "rocm",
    12: "ext_dev",
    13: "cuda_managed",
    14: "oneapi",
    15: "webgpu",
    16: "hexagon",
    17: "maia",
}
_HOST = (1, 3)


def pin(obj: Any, what: str) -> Pinned | None:
    device = _device_of(obj)
    if device is None:
        return None
    raise UnsupportedMemory(
        f"{what}: memory on device {device} is not supported yet (host memory only: copy it to CPU)"
    )


def _device_of(obj: Any) -> str | None:
    """The device ``obj`` lives on, or None for host memory and objects of no known kind."""
    if is_tensor(obj):
        return None if obj.device.type == "cpu" else str(obj.device)
    if hasattr(obj, "__cuda_array_interface__"):
        return "cuda (__cuda_array_interface__)"
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None:
        try:
            kind, index = dlpack_device()
        except Exception:
            return None
        if int(kind) not in _HOST:
            return f"{_DLPACK_DEVICES.get(int(kind), f'dlpack type {int(kind)}')}:{index} (DLPack)"
    return None
