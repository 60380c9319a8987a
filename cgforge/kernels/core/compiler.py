"""CUDA C++ source -> cubin through NVRTC (ctypes), with a crash-safe disk cache.

Needs only libnvrtc (no GPU); the ptxas report in NVRTC's log gives per-kernel resources. An entry is written
to a temporary file, fsync'ed and renamed, and checked by a checksum; no lock files (writers of one key write the
same bytes). The environment (``ENVIRONMENT``) is read here only, at each call; none of it changes a kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import glob
import hashlib
import json
import os
import re
import struct
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from cgforge.atomic import atomic_write

# Bump when the entry layout or anything that changes the cubin for the same inputs changes.
CACHE_FORMAT_VERSION = 1
# No --use_fast_math (results must match e3nn), no -lineinfo (bigger cubins, nothing gained at run time).
DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17", "-default-device")
# Makes ptxas print registers/spills/smem per kernel into the NVRTC log.
_PTXAS_VERBOSE = "--ptxas-options=-v"
# NVRTC (12.x/13.x) keeps its own cache in the driver's ComputeCache (~/.nv) when a driver is present; a
# hit there returns the cubin with an EMPTY log, i.e. no ptxas report. Ours replaces it, so turn it off.
_NO_NVRTC_CACHE = "--no-cache"
_ARCH_RE = re.compile(r"^sm_(\d{2,3})[af]?$")
_STALE_TEMP_SECONDS = 3600.0


class KernelError(Exception):
    """Base of the errors raised by cgforge.kernels (defined here: this module imports nothing of cgforge,
    so it loads on its own; `core.errors` re-exports it)."""


class NvrtcUnavailableError(KernelError, RuntimeError):
    """libnvrtc could not be found or loaded; the message lists every place that was tried."""


class CompileError(KernelError, RuntimeError):
    """NVRTC rejected the source. `log` is NVRTC's log; the message adds the source lines around errors."""

    def __init__(self, message: str, *, log: str, source_name: str, options: tuple[str, ...]):
        super().__init__(message)
        self.log = log
        self.source_name = source_name
        self.options = options


class KernelCacheWarning(UserWarning):
    """The disk cache could not be used as intended (corrupt entry, unwritable directory)."""


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One kernel's line of the ptxas report. Sizes are bytes."""

    name: str
    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    shared_mem: int = 0  # static shared memory; dynamic shared memory is chosen at launch
    barriers: int = 0
    const_mem: int = 0  # cmem[0]: kernel parameters and the like

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclasses.dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    arch: str
    options: tuple[str, ...]
    # ptxas names (lowered/mangled for C++ kernels, plain for extern "C") -> resources. Plain dicts, so
    # that modules holding a result can be deep-copied and pickled; treat them as read-only.
    kernels: Mapping[str, KernelResources] = dataclasses.field(hash=False)
    # name expression given to compile_cubin -> lowered (mangled) name to load from the module.
    lowered_names: Mapping[str, str] = dataclasses.field(hash=False)
    cache_key: str = ""

    def resources(self, name: str) -> KernelResources:
        """Resources of kernel `name` (a name expression or the name ptxas printed)."""
        lowered = self.lowered_names.get(name, name)
        try:
            return self.kernels[lowered]
        except KeyError:
            raise KeyError(f"no kernel named {name!r} in the ptxas report; kernels: {sorted(self.kernels)}") \
                from None


def _site_dirs() -> list[str]:
    dirs = list(sys.path)
    try:
        import site

        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except (AttributeError, ImportError):  # virtualenv's old site module lacks these
        pass
    seen: set[str] = set()
    return [d for d in dirs if d and not (d in seen or seen.add(d))]


# The only environment variables the kernels read: where the disk cache lives, turning it off, which libnvrtc.
ENVIRONMENT = {"CGFORGE_CACHE_DIR": "the kernel disk cache's directory (default ~/.cache/cgforge/kernels)",
               "CGFORGE_CACHE_DISABLE": "1, true or yes: compile in every process, no disk cache",
               "CGFORGE_NVRTC_PATH": "the libnvrtc.so to load first"}

_LIB_NAME_RE = re.compile(r"^libnvrtc\.so(\.\d+)*$")  # not libnvrtc-builtins, not libnvrtc.alt


def _libraries(pattern: str) -> list[str]:
    """The libnvrtc files ``pattern`` matches, newest version first."""
    found = [p for p in glob.glob(pattern, recursive=True) if _LIB_NAME_RE.match(os.path.basename(p))]
    return sorted(found, key=lambda p: tuple(int(x) for x in re.findall(r"\d+", os.path.basename(p))), reverse=True)


def _candidate_library_paths() -> list[str]:
    candidates: list[str] = []
    override = os.environ.get("CGFORGE_NVRTC_PATH")
    if override:
        candidates.append(override)
    for site_dir in _site_dirs():
        nvidia = os.path.join(site_dir, "nvidia")
        if os.path.isdir(nvidia):
            # Known wheel layouts first (cu12: cuda_nvrtc/lib, cu13: cu13/lib), then anything under nvidia/.
            for pattern in ("cuda_nvrtc/lib/libnvrtc.so*", "cu*/lib/libnvrtc.so*", "**/libnvrtc.so*"):
                candidates += _libraries(os.path.join(nvidia, pattern))
    system = ctypes.util.find_library("nvrtc")
    if system:
        candidates.append(system)
    for root in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"))):
        for sub in ("lib64", "lib"):
            candidates += _libraries(os.path.join(root, sub, "libnvrtc.so*"))
    candidates += _libraries("/usr/local/cuda/lib64/libnvrtc.so*")
    return list(dict.fromkeys(candidates))


class _Nvrtc:
    """The few NVRTC entry points we use, with argument types declared."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.path = path
        self._lib = lib
        P, S, I, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
        decl = {"nvrtcVersion": [ctypes.POINTER(I), ctypes.POINTER(I)],
                "nvrtcCreateProgram": [ctypes.POINTER(P), C, C, I, ctypes.POINTER(C), ctypes.POINTER(C)],
                "nvrtcDestroyProgram": [ctypes.POINTER(P)], "nvrtcCompileProgram": [P, I, ctypes.POINTER(C)],
                "nvrtcGetProgramLogSize": [P, ctypes.POINTER(S)], "nvrtcGetProgramLog": [P, C],
                "nvrtcGetCUBINSize": [P, ctypes.POINTER(S)], "nvrtcGetCUBIN": [P, C], "nvrtcAddNameExpression": [P, C],
                "nvrtcGetLoweredName": [P, C, ctypes.POINTER(C)]}
        for fn, argtypes in decl.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = argtypes, I
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [I], C
        major, minor = I(), I()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        self.archs: tuple[int, ...] = ()
        if hasattr(lib, "nvrtcGetNumSupportedArchs"):  # NVRTC >= 11.2
            n = I()
            self._check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
            arr = (I * n.value)()
            self._check(lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
            self.archs = tuple(arr)
        self.accepts_no_cache = self.compile('extern "C" __global__ void probe() {}', "probe.cu", [_NO_NVRTC_CACHE],
                                             [])[0] == 0
        real = os.path.realpath(path) if os.path.exists(path) else path
        size = os.path.getsize(real) if os.path.exists(real) else 0
        # nvrtcVersion gives only major.minor; the file size tells patch releases apart for the cache key.
        self.fingerprint = f"{major.value}.{minor.value}:{size}"

    def error_string(self, code: int) -> str:
        return self._lib.nvrtcGetErrorString(code).decode(errors="replace")

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self.error_string(code)} ({code})")

    def compile(self, source: str, name: str, options: Sequence[str], name_expressions: Sequence[str]
                ) -> tuple[int, str, bytes, dict[str, str]]:
        """Returns (nvrtc result code, log, cubin or b'', lowered names)."""
        lib = self._lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            for expr in name_expressions:
                self._check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            code = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            if code != 0:
                return code, log, b"", {}
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin_buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin_buf), "nvrtcGetCUBIN")
            lowered = {}
            for expr in name_expressions:
                out = ctypes.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
                lowered[expr] = out.value.decode()
            return code, log, cubin_buf.raw, lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


_nvrtc: _Nvrtc | None = None
_nvrtc_lock = threading.Lock()


def _load_nvrtc() -> _Nvrtc:
    global _nvrtc
    if _nvrtc is not None:
        return _nvrtc
    with _nvrtc_lock:
        if _nvrtc is None:
            tried: list[str] = []
            for path in _candidate_library_paths():
                try:
                    _nvrtc = _Nvrtc(path)
                    break
                except (OSError, AttributeError, RuntimeError) as e:
                    tried.append(f"  {path}: {e}")
            else:
                detail = "\n".join(tried) if tried else "  (no libnvrtc.so* found anywhere)"
                raise NvrtcUnavailableError(
                    "libnvrtc could not be loaded. Install the NVRTC wheel (pip install "
                    "nvidia-cuda-nvrtc-cu12), or set CGFORGE_NVRTC_PATH to a libnvrtc.so. Tried:\n" + detail)
    return _nvrtc


def nvrtc_available() -> bool:
    try:
        _load_nvrtc()
    except NvrtcUnavailableError:
        return False
    return True


def nvrtc_version() -> tuple[int, int]:
    return _load_nvrtc().version


def nvrtc_library_path() -> str:
    return _load_nvrtc().path


def supported_archs() -> tuple[str, ...]:
    """Real architectures NVRTC can build cubins for, e.g. ('sm_75', ..., 'sm_90', ...)."""
    return tuple(f"sm_{a}" for a in _load_nvrtc().archs)


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FIELDS = {"stack_frame": re.compile(r"(\d+) bytes stack frame"),
           "spill_stores": re.compile(r"(\d+) bytes spill stores"),
           "spill_loads": re.compile(r"(\d+) bytes spill loads")}
_USED_FIELDS = {"registers": re.compile(r"Used (\d+) registers"), "barriers": re.compile(r"used (\d+) barriers"),
                "shared_mem": re.compile(r"(\d+) bytes smem"), "const_mem": re.compile(r"(\d+) bytes cmem\[0\]")}


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per-kernel resources from a `ptxas -v` report (as NVRTC returns it in the program log): lines such as
    ``Compiling entry function 'axpy'``, ``Function properties for axpy``, ``0 bytes stack frame, ...`` and
    ``Used 10 registers, used 0 barriers, 380 bytes cmem[0]``."""
    fields: dict[str, dict[str, int]] = {}
    entry: str | None = None  # kernel whose "Used ..." line comes next
    props_of: str | None = None  # function whose stack/spill line comes next
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            entry = m.group(1)
            fields.setdefault(entry, {})
        elif m := _PROPS_RE.search(line):
            props_of = m.group(1)
        elif "bytes stack frame" in line and props_of is not None:
            if props_of in fields or props_of == entry:
                target = fields.setdefault(props_of, {})
                for key, rx in _FIELDS.items():
                    if fm := rx.search(line):
                        target[key] = int(fm.group(1))
            props_of = None
        elif "Used" in line and "registers" in line and entry is not None:
            target = fields[entry]
            for key, rx in _USED_FIELDS.items():
                if fm := rx.search(line):
                    target[key] = int(fm.group(1))
            entry = None
    return {name: KernelResources(name=name, **{"registers": 0, **vals}) for name, vals in fields.items()}


def _error_context(source: str, name: str, log: str, radius: int = 2, max_errors: int = 5) -> str:
    """Numbered source lines around each line NVRTC reports an error on."""
    lines = source.splitlines()
    rx = re.compile(rf"^{re.escape(name)}\((\d+)\): (?:catastrophic )?error", re.MULTILINE)
    error_lines = sorted({int(m.group(1)) for m in rx.finditer(log)})[:max_errors]
    blocks = []
    width = len(str(len(lines)))
    for ln in error_lines:
        lo, hi = max(1, ln - radius), min(len(lines), ln + radius)
        blocks.append("\n".join(f"{'>' if i == ln else ' '} {i:>{width}} | {lines[i - 1]}" for i in range(lo, hi + 1)))
    return "\n...\n".join(blocks)


def _str_tuple(label: str, seq: object) -> tuple[str, ...]:
    is_str_sequence = isinstance(seq, Sequence) and all(isinstance(o, str) for o in seq)
    if isinstance(seq, (str, bytes)) or not is_str_sequence:
        raise TypeError(f"{label} must be a sequence of str (a list or tuple), got {seq!r}")
    return tuple(seq)


def _check_arguments(source: object, arch: object, options: object, name: object,
                     name_expressions: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validates everything; returns (options, name_expressions) as tuples."""
    if not isinstance(source, str) or not source.strip():
        raise TypeError(f"source must be a non-empty str of CUDA C++, got {type(source).__name__}")
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(f"arch must look like 'sm_90' (a real architecture, for a cubin), got {arch!r}")
    opts, exprs = _str_tuple("options", options), _str_tuple("name_expressions", name_expressions)
    for o in opts:
        if o.startswith(("-arch", "--gpu-architecture")):
            raise ValueError(f"options must not set the architecture ({o!r}); pass arch= instead")
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str (the source's file name in messages), got {name!r}")
    return opts, exprs


def _full_options(arch: str, options: Sequence[str]) -> tuple[str, ...]:
    user_sets_std = any(o.startswith(("--std", "-std")) for o in options)
    defaults = [o for o in DEFAULT_OPTIONS if not (user_sets_std and o.startswith("--std"))]
    no_cache = (_NO_NVRTC_CACHE,) if _load_nvrtc().accepts_no_cache else ()
    return (f"--gpu-architecture={arch}", *defaults, _PTXAS_VERBOSE, *no_cache, *options)


def cache_key(source: str, *, arch: str, options: Sequence[str] = (), name: str = "kernel.cu",
              name_expressions: Sequence[str] = ()) -> str:
    """The disk-cache key: sha256 of everything that decides the cubin."""
    opts, exprs = _check_arguments(source, arch, options, name, name_expressions)
    return _cache_key(source, arch, _full_options(arch, opts), name, exprs)


def _cache_key(source: str, arch: str, full_options: Sequence[str], name: str, name_expressions: Sequence[str]) -> str:
    material = json.dumps([CACHE_FORMAT_VERSION, _load_nvrtc().fingerprint, arch, list(full_options), name,
                           list(name_expressions), source])
    return hashlib.sha256(material.encode()).hexdigest()


def _compile_with_nvrtc(source: str, name: str, options: tuple[str, ...], name_expressions: tuple[str, ...]
                        ) -> tuple[str, bytes, dict[str, str]]:
    """One NVRTC compilation (tests count calls to this). Raises CompileError."""
    nvrtc = _load_nvrtc()
    code, log, cubin, lowered = nvrtc.compile(source, name, options, name_expressions)
    if code != 0:
        context = _error_context(source, name, log)
        message = (f"NVRTC failed to compile {name} ({nvrtc.error_string(code)}) "
                   f"with options {list(options)}:\n{log}")
        if context:
            message += f"\nSource around the error:\n{context}"
        raise CompileError(message, log=log, source_name=name, options=options)
    return log, cubin, lowered


_memory_cache: dict[str, CompileResult] = {}
_memory_lock = threading.Lock()
_warned_dirs: set[str] = set()


def clear_memory_cache() -> None:
    """Forget in-process results (the disk cache stays), and allow 'unwritable cache' warnings again."""
    with _memory_lock:
        _memory_cache.clear()
        _warned_dirs.clear()


def compile_cubin(source: str, *, arch: str, options: Sequence[str] = (), name: str = "kernel.cu",
                  name_expressions: Sequence[str] = ()) -> CompileResult:
    """Compile CUDA C++ `source` to a cubin for `arch` (e.g. 'sm_90'), cached in memory and on disk. `options`: extra
    NVRTC options; `name_expressions` (e.g. 'my_kernel<float, 4>'): lowered to the mangled names a loader needs
    (``CompileResult.lowered_names``). Raises CompileError with NVRTC's log."""
    opts, exprs = _check_arguments(source, arch, options, name, name_expressions)
    nvrtc = _load_nvrtc()
    number = int(_ARCH_RE.match(arch).group(1))  # type: ignore[union-attr]
    if nvrtc.archs and number not in nvrtc.archs:
        raise ValueError(f"arch {arch!r} is not supported by NVRTC {nvrtc.version} ({nvrtc.path}); "
                         f"supported: {', '.join(supported_archs())}")
    full_options = _full_options(arch, opts)
    key = _cache_key(source, arch, full_options, name, exprs)
    with _memory_lock:
        hit = _memory_cache.get(key)
    if hit is not None:
        return hit
    use_disk = os.environ.get("CGFORGE_CACHE_DISABLE", "") not in ("1", "true", "yes")
    result = _read_entry(key, full_options) if use_disk else None
    if result is None:
        log, cubin, lowered = _compile_with_nvrtc(source, name, full_options, exprs)
        result = _make_result(key, arch, full_options, log, cubin, lowered)
        if use_disk:
            _write_entry(result)
    with _memory_lock:
        _memory_cache[key] = result
    return result


def _make_result(key: str, arch: str, options: tuple[str, ...], log: str, cubin: bytes,
                 lowered: Mapping[str, str]) -> CompileResult:
    return CompileResult(cubin=cubin, log=log, arch=arch, options=options, kernels=parse_ptxas_report(log),
                         lowered_names=dict(lowered), cache_key=key)


# Entry file <key>.cgk = header + payload
#   header  = magic (8 bytes) | format version (u32) | payload length (u64) | sha256(payload) (32 bytes)
#   payload = metadata length (u32) | metadata JSON (key, arch, log, lowered names) | cubin

_MAGIC = b"CGFKRNL\x00"
_HEADER = struct.Struct("<8sIQ32s")
_META_LEN = struct.Struct("<I")


def cache_dir() -> Path:
    """$CGFORGE_CACHE_DIR, else ~/.cache/cgforge/kernels (read at every call)."""
    configured = os.environ.get("CGFORGE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "cgforge" / "kernels"


def cache_entry_path(key: str) -> Path:
    return cache_dir() / f"{key}.cgk"


def _encode_entry(result: CompileResult) -> bytes:
    meta = json.dumps({"key": result.cache_key, "arch": result.arch, "log": result.log,
                       "lowered_names": dict(result.lowered_names)}).encode()
    payload = _META_LEN.pack(len(meta)) + meta + result.cubin
    header = _HEADER.pack(_MAGIC, CACHE_FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    return header + payload


def _decode_entry(data: bytes, key: str, options: tuple[str, ...]) -> CompileResult:
    """Raises ValueError saying what is wrong with a damaged entry."""
    if len(data) < _HEADER.size:
        raise ValueError(f"truncated header ({len(data)} bytes)")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not a cgforge kernel entry (bad magic)")
    if version != CACHE_FORMAT_VERSION:
        raise ValueError(f"format version {version}, expected {CACHE_FORMAT_VERSION}")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise ValueError(f"truncated: {len(payload)} of {length} payload bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch")
    (meta_len,) = _META_LEN.unpack_from(payload)
    meta = json.loads(payload[_META_LEN.size:_META_LEN.size + meta_len])
    if meta.get("key") != key:
        raise ValueError("entry belongs to another key")
    cubin = payload[_META_LEN.size + meta_len:]
    return _make_result(key, meta["arch"], options, meta["log"], cubin, meta["lowered_names"])


def _read_entry(key: str, options: tuple[str, ...]) -> CompileResult | None:
    path = cache_entry_path(key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn_once(path.parent, f"cgforge kernel cache directory {path.parent} is not usable: cannot read "
                                f"{path.name} ({e}); compiling instead")
        return None
    try:
        return _decode_entry(data, key, options)
    except (ValueError, KeyError, TypeError, struct.error) as e:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"cgforge kernel cache entry {path} is damaged ({e}); deleting it and recompiling",
                      KernelCacheWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _write_entry(result: CompileResult) -> None:
    path = cache_entry_path(result.cache_key)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(_encode_entry(result)))
    except OSError as e:
        _warn_once(directory, f"cgforge kernel cache directory {directory} is not writable ({e}); "
                              "compiled kernels are kept in memory only for this process")
        return
    _remove_stale_temp_files(directory)


def _remove_stale_temp_files(directory: Path) -> None:
    """Temp files left by processes killed mid-write; old enough that no writer can still own them."""
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for tmp in directory.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()


def _warn_once(directory: Path, message: str) -> None:
    with _memory_lock:
        if str(directory) in _warned_dirs:
            return
        _warned_dirs.add(str(directory))
    warnings.warn(message, KernelCacheWarning, stacklevel=4)
