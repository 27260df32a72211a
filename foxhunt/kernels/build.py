"""C kernels compiled on first use: the one build, cache and verification of every C source in this package.

A kernel's module (:mod:`foxhunt.kernels.mamba2_block`) hands :func:`load` its C source (a ``.c`` file beside it),
flags and a self-check against its PyTorch reference. The source is compiled
with the system's C compiler (``$CC``, else ``cc``) into the user's cache (``$FOXHUNT_CACHE``, else
``$XDG_CACHE_HOME/foxhunt``, else ``~/.cache/foxhunt``), under a name that hashes the source, the flags and defines,
the compiler's version and the machine's CPU (``-march=native`` vectorises for it; a compiler that refuses that flag
gets the rest). A cached library is verified before it is loaded (the SHA-256 recorded beside it when it was built: one
that differs is rebuilt) and its self-check runs once after (one that fails is removed and not used). Without a
compiler, or with ``FOXHUNT_NATIVE=0``, :func:`load` gives None (with one warning where a compiler is missing) and the
caller runs its plain torch path.

Why C through :mod:`ctypes` and not a built extension or numba: no new dependency, no build step for an editable
install, and a C compiler is present wherever Python's headers are.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path


def enabled() -> bool:
    """False where the user switched the compiled loops off (``FOXHUNT_NATIVE=0``)."""
    return os.environ.get("FOXHUNT_NATIVE", "1") != "0"


def cache_dir() -> Path:
    """Where compiled libraries are kept (see the module docstring)."""
    if os.environ.get("FOXHUNT_CACHE"):
        return Path(os.environ["FOXHUNT_CACHE"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "foxhunt" / "native"


def compiler() -> str | None:
    """The C compiler's path ($CC, else cc), or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else the processor's name, so a
    cache shared by different machines keeps one library per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def digest(path: Path) -> str:
    """The SHA-256 of a file, as recorded beside a built library."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(cc: str, directory: Path, name: str, source: str, flags: Sequence[str], libs: Sequence[str] = ("-lm",),
          defines: Sequence[str] = ()) -> Path:
    """The library ``name`` for this source, flags, defines, compiler and machine: the cached one if its recorded
    digest matches, else compiled afresh (into a temporary file, then renamed, so concurrent builds never see a
    partial file). Where the compiler refuses ``-march=native``, the same flags without it."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    parts = (source, *flags, *libs, *defines, version, platform.machine(), _cpu())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    lib, sha = directory / f"{name}-{key}.so", directory / f"{name}-{key}.sha256"
    if lib.exists() and sha.exists() and sha.read_text().strip() == digest(lib):
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    portable = [f for f in flags if f != "-march=native"]
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        for attempt in (list(flags), portable):
            done = subprocess.run([cc, *attempt, *defines, "-shared", "-fPIC", "-o", str(out), str(src), *libs],
                                  capture_output=True, text=True, check=False)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not compile foxhunt's {name} loops: {done.stderr.strip()[:500]}")
        built = digest(out)
        os.replace(out, lib)
    sha.write_text(built + "\n")
    return lib


def load(name: str, source: str, flags: Sequence[str], declare: Callable[[ctypes.CDLL], None],
         self_check: Callable[[ctypes.CDLL], bool], fallback: str, defines: Sequence[str] = ()) -> ctypes.CDLL | None:
    """The compiled library ``name``, built or verified, its functions declared by ``declare`` and checked by
    ``self_check``; None (with one warning saying ``fallback``, what runs instead) where it cannot be had."""
    if not enabled():
        return None
    cc = compiler()
    if cc is None:
        warnings.warn(f"foxhunt: no C compiler (cc, or $CC) found; {fallback}", RuntimeWarning, stacklevel=3)
        return None
    try:
        path = build(cc, cache_dir(), name, source, flags, defines=defines)
        lib = ctypes.CDLL(str(path))
        declare(lib)
        if not self_check(lib):  # loads but computes wrongly: removed, so that the next process builds it afresh
            path.unlink(missing_ok=True)
            raise RuntimeError(f"{path} computes wrongly (removed)")
        return lib
    except (OSError, RuntimeError) as e:
        warnings.warn(f"foxhunt: the compiled {name} loops are unavailable ({e}); {fallback}", RuntimeWarning,
                      stacklevel=3)
        return None
