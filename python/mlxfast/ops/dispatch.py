"""Where an op runs: the native CPU kernels of ``mlxfast._ext`` or the pure-MLX
references, and which CPU kernel path (ISA) they use.

Every op asks ``on_cpu(stream)`` (looked up on this module at call time, so a
test can force the reference path everywhere by patching it once).
"""

from __future__ import annotations

import mlx.core as mx

from .. import _ext


def on_cpu(stream=None) -> bool:
    """Whether ``stream`` (default: the default device) is the CPU: the native kernels run there."""
    if stream is None:
        return mx.default_device() == mx.cpu
    if isinstance(stream, mx.Device):
        return stream == mx.cpu
    return stream.device == mx.cpu


def cpu_path() -> str:
    """The native CPU kernel path in use: ``portable``, ``avx2``, ``avx512`` or ``neon``.

    ``MLXFAST_CPU_PATH`` in the environment lowers it (e.g. to test the
    portable path on an AVX-512 machine).
    """
    return _ext.cpu_path()


def set_cpu_path(name: str = "") -> None:
    """Force a CPU kernel path for the process; ``""`` restores the automatic choice."""
    _ext.set_cpu_path(name)


def int8_activations_unsupported() -> str:
    """``""`` where this CPU runs the int8-activation matmul natively (the
    AVX2 or AVX-512 path); otherwise a sentence naming what is missing."""
    return _ext.int8_activations_unsupported()


def int8_activations_layout() -> str:
    """The weight layout the native int8-activation kernels read:
    ``"rows16"`` (AVX-512 VNNI and AVX2, see ``pack_rows16``); ``""`` where
    there is none."""
    return _ext.int8_activations_layout()


def cpu_supports(name: str) -> bool:
    """Whether this CPU can run the named kernel path."""
    return _ext.cpu_supports(name)


def num_threads() -> int:
    """Threads the native kernels use (``MLXFAST_NUM_THREADS`` overrides)."""
    return _ext.num_threads()
