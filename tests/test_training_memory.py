"""The scoped allocator setting of foxhunt.fit: big blocks come from glibc's reusable heap inside, from mmap outside."""

from __future__ import annotations

import ctypes

import pytest
import torch

from foxhunt.training.memory import glibc, retain_freed_memory


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (size_t fields; hblkhd: bytes in mmap'd blocks)."""

    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def mapped_bytes_of_a_big_tensor() -> int:
    """Bytes glibc holds in mmap'd blocks while a fresh 64 MiB tensor is alive, less those before it."""
    libc = glibc()
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblkhd
    x = torch.empty(16 * 2**20, dtype=torch.float32)
    during = libc.mallinfo2().hblkhd
    del x
    return during - before


@pytest.fixture
def libc() -> ctypes.CDLL:
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    return libc


def test_retain_freed_memory_serves_big_blocks_from_the_heap_and_restores_mmap(libc: ctypes.CDLL) -> None:
    assert mapped_bytes_of_a_big_tensor() >= 64 * 2**20  # glibc's default: a block this big is mmap'd
    with retain_freed_memory() as applied:
        assert applied
        assert mapped_bytes_of_a_big_tensor() == 0
    assert mapped_bytes_of_a_big_tensor() >= 64 * 2**20  # restored on exit


def test_retain_freed_memory_switched_off_leaves_the_allocator_alone(libc: ctypes.CDLL) -> None:
    with retain_freed_memory(False) as applied:
        assert not applied
        assert mapped_bytes_of_a_big_tensor() >= 64 * 2**20


def test_retain_freed_memory_restores_the_defaults_after_an_error(libc: ctypes.CDLL) -> None:
    with pytest.raises(RuntimeError, match="boom"), retain_freed_memory():
        raise RuntimeError("boom")
    assert mapped_bytes_of_a_big_tensor() >= 64 * 2**20
