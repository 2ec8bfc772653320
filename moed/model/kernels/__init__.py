"""Native CPU kernels (cpu_bf16.c), compiled on first use and loaded with ctypes.

Decode on a CPU is a few rows times big weights: memory-bound work that torch spreads over ~60
small ops per MoE layer, each with its own dispatch cost, and whose bf16 matmuls read a weight
once per row. These kernels do it in five calls per layer: `moe_bf16` (router, top-k, experts,
weighted sum; each touched expert read once), `linear_bf16` (skinny matmuls on a packed weight),
`decode_attn_bf16` (paged attention straight from the KV blocks; `prefill_attn_bf16` for
prompts, blocked over queries), `rms_norm_bf16` (with the residual add) and `qk_norm_rope_bf16`;
`moed_qlinear` and `moed_moe_q` (cpu_quant.c, kernels/quant.py): int8/int4/fp8 weights;
`moed_decode_step` (cpu_step.c) strings them together over a whole decode step (decode_step.py). x86-64
CPUs only; the sources built per ISA variant (ISAS: avx512bf16; avx512, AVX512F/BW/VL without BF16,
through cpu_avx512.h; avx2, AVX2 + FMA, through cpu_avx2.h; all bitwise the same results), the
fastest this CPU runs picked at load from /proc/cpuinfo, or the one MOED_CPU_ISA names (layouts, numerics: the C files).

Why build at run time rather than ship a wheel: the project installs as pure Python (no build
step that could break a GPU install); the C files compile (compile.py: at once, a compiler a
core; ~8 s a variant on two cores) with the C compiler any Debian/Ubuntu host has. The .so is cached by variant and a hash of the source and flags in
$MOED_KERNEL_CACHE, else systemd's $CACHE_DIRECTORY (the unit has CacheDirectory=),
else $XDG_CACHE_HOME/moed or ~/.cache/moed. If anything is missing (no compiler, other CPU,
read-only cache, MOED_CPU_KERNELS=0) callers get None and keep the torch path, which computes
the same thing; the reason is logged once. `moed model kernels` builds the cache ahead of time
(an image build, a host whose runtime has no compiler).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

from moed.model.kernels.choice import KernelChooser
from moed.model.kernels.compile import CompileFailed, compile_shared
from moed.model.kernels.quant import bind as bind_quant

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_bf16.c")
# compiled into the same .so: quantized-weight matmuls (int8 / int4 / fp8), their integer-dot path
# for int8 activations (model.quantization_activations), the decode step, absorbed MLA attention (mla.py)
EXTRA_SOURCES = tuple(SOURCE.with_name(f) for f in ("cpu_quant.c", "cpu_qdot.c", "cpu_step.c", "cpu_mla.c"))
HEADERS = (*(SOURCE.with_name(h) for h in ("cpu_avx2.h", "cpu_avx512.h", "cpu_bf16_scalar.h")), *EXTRA_SOURCES)
# No -march=native: a cached .so must run on any CPU of its variant that shares the cache.
# -fno-strict-aliasing: the kernels read bf16 pairs through uint32 pointers.
# -ffp-contract=off: no multiply-add fused unless the source spells it (the variants would part).
COMMON_CFLAGS = ("-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
# The variants, fastest first: the flags each is compiled with and the /proc/cpuinfo flags a CPU
# needs to run it. avx512bf16: Zen4, Sapphire Rapids and later; avx512: Skylake-SP to Ice Lake
# (VNNI, where present, is checked at run time by cpu_qdot.c); avx2 is x86-64-v3 (Haswell, Zen1 and
# later). All compute the same bits (cpu_avx512.h and cpu_avx2.h say how).
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")
ISA_CFLAGS: dict[str, tuple[str, ...]] = {"avx512bf16": (*_AVX512, "-mavx512bf16"), "avx512": _AVX512,
                                          "avx2": ("-march=x86-64-v3",)}
ISA_NEEDS: dict[str, frozenset[str]] = {
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
}
ISAS = tuple(ISA_CFLAGS)
ISA_ENV = "MOED_CPU_ISA"
ABI_VERSION = 19
BLOCK = 32          # output columns per packed block (NB in cpu_bf16.c)

_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class KernelUnavailable(RuntimeError):
    pass


class IsaRefused(ValueError):
    """MOED_CPU_ISA names no variant, or one this CPU cannot run: an operator's error, raised
    (not logged and served on the torch path, which would hide that the setting did nothing)."""


def _cache_dir() -> Path:
    for var in ("MOED_KERNEL_CACHE", "CACHE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moed"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler (set CC, or install gcc)")
    return cc


def build(cache: Path | None = None, isa: str | None = None) -> Path:
    """Return the .so of variant `isa` (default: the one this CPU picks, else the first) for
    this source and these flags, compiling it into the cache if absent.

    The name carries the variant and hashes the source, flags and ABI version only, not the
    compiler: a cache filled ahead of time (`moed model kernels`, e.g. in an image build) serves
    hosts with no compiler, and holds every variant side by side."""
    isa = isa or best_isa() or ISAS[0]
    if isa not in ISA_CFLAGS:
        raise KernelUnavailable(f"no kernel variant {isa!r} (variants: {', '.join(ISAS)})")
    flags = COMMON_CFLAGS + ISA_CFLAGS[isa]
    text = [SOURCE.read_text(), *(h.read_text() for h in HEADERS)]
    key = hashlib.sha256("\0".join([*text, " ".join(flags), str(ABI_VERSION)]).encode())
    cache = cache or _cache_dir()
    out = cache / f"moed_cpu_bf16-{isa}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = _compiler()
    try:
        subprocess.run([cc, "--version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"C compiler {cc!r} does not run: {e}") from e
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"kernel cache {cache} is not writable: {e}") from e
    try:
        compile_shared(cc, flags, (SOURCE, *EXTRA_SOURCES), Path(tmp))
        os.chmod(tmp, 0o755)     # mkstemp made it 0600: other users sharing the cache load it too
        os.replace(tmp, out)     # atomic: processes building at once each install a whole file
    except CompileFailed as e:
        raise KernelUnavailable(f"compiling {e.step} ({isa}) failed: {e.stderr.strip()[-500:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"compiling {SOURCE.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("cpu_kernels_built", path=str(out), isa=isa)
    return out


class CpuKernels:
    """The loaded library. Thread count per call follows torch.get_num_threads()."""

    def __init__(self, path: Path, isa: str | None = None) -> None:
        """isa: the variant `path` must be (refused otherwise); None: whichever it is."""
        # torch is imported (above), so its libgomp is already loaded: the .so's libgomp.so.1
        # resolves to that one, and these kernels share torch's OpenMP thread pool.
        lib = ctypes.CDLL(str(path))
        if lib.moed_abi_version() != ABI_VERSION:
            raise KernelUnavailable(f"{path} has ABI {lib.moed_abi_version()}, expected {ABI_VERSION}")
        lib.moed_isa.restype = ctypes.c_char_p
        got = lib.moed_isa().decode()
        if isa is not None and got != isa:
            raise KernelUnavailable(f"{path} is the {got} variant, not {isa}")
        if not lib.moed_cpu_supported():
            raise KernelUnavailable(f"this CPU cannot run the {got} kernels ({isa_missing(got)})")
        self.isa = got
        # whether this CPU's dot product sums in the order all variants share (cpu_bf16.c)
        self.dot_order_ok = bool(lib.moed_dot_order_matches())
        lib.moed_moe_bf16.argtypes = [_p, _l, _l, _p, _l, _l, _i, _p, _l, _p, _l, _p, _p, _p, _l, _l, _p, _i]
        lib.moed_moe_bf16.restype = _i
        lib.moed_route_bf16.argtypes = [_p, _l, _l, _p, _l, _l, _i, _p, _l, _p, _l, _p, _l, _p, _p, _i]
        lib.moed_route_bf16.restype = _i
        lib.moed_experts_bf16.argtypes = [_p, _l, _l, _p, _p, _p, _l, _l, _p, _i]
        lib.moed_experts_bf16.restype = _i
        lib.moed_linear_bf16.argtypes, lib.moed_linear_bf16.restype = [_p, _l, _l, _p, _l, _p, _p, _i], _i
        lib.moed_decode_attn_bf16.argtypes = [_p, _l, _l, _l, _l, _l, _p, _l, _l, _p, _l, _p,
                                              ctypes.c_float, _p, _i]
        lib.moed_decode_attn_bf16.restype = _i
        lib.moed_prefill_attn_bf16.argtypes, lib.moed_prefill_attn_bf16.restype = \
            [_p, _l, _l, _l, _l, _l, _l, _p, _p, ctypes.c_float, _p, _i], _i
        lib.moed_rms_norm_bf16.argtypes = [_p, _p, _p, _l, _l, _p, ctypes.c_float, _p, _i]
        lib.moed_rms_norm_bf16.restype = None
        lib.moed_qk_norm_rope_bf16.argtypes = [_p, _l, _l, _l, _l, _p, ctypes.c_float, _p, _p, _p, _i]
        lib.moed_qk_norm_rope_bf16.restype = None
        # (model struct, B, ids, pos, tables, max_blocks, offsets, cos, sin, scratch, logits,
        # argmax, threads): cpu_step.c; the structs and the caller are moed/model/decode_step.py
        lib.moed_decode_step.argtypes = [_p, _l, _p, _p, _p, _l, _p, _p, _p, _p, _p, _p, _i]
        lib.moed_decode_step.restype = _i
        for f in (lib.moed_decode_step_scratch, lib.moed_decode_step_hidden_offset):
            f.argtypes, f.restype = [_p, _l], _l
        lib.moed_argmax_f32.argtypes, lib.moed_argmax_f32.restype = [_p, _l, _l, _p, _i], None
        lib.moed_lut_u8_to_u16.argtypes, lib.moed_lut_u8_to_u16.restype = [_p, _l, _p, _p, _i], None
        bind_quant(lib)          # moed_qlinear (cpu_quant.c; the caller is kernels/quant.py)
        # the 256 e4m3 bytes as bf16, by torch's own cast (exact: each is a bf16 value)
        self._fp8_lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn) \
            .to(torch.bfloat16).view(torch.int16).contiguous()
        self.lib, self.path = lib, path
        # (N, K) -> LinearChoice: native or oneDNN per row class, measured once (choice.py)
        self.choose = KernelChooser(self, path)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """The kernels' weight layout ("P32", see cpu_bf16.c) of bf16 weight [..., N, K]:
        [..., ceil(N/32), K/2, 32, 2], zero rows padding N. K must be even."""
        *lead, n, k = weight.shape
        if k % 2:
            raise ValueError(f"packed weights need an even input size, got {k}")
        pad = -n % BLOCK
        if pad:
            weight = torch.nn.functional.pad(weight, (0, 0, 0, pad))
        return (weight.reshape(*lead, (n + pad) // BLOCK, BLOCK, k // 2, 2)
                .transpose(-3, -2).contiguous())

    @staticmethod
    def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
        """The plain weight [..., n, K] back from pack()'s layout (exact: a reshuffle)."""
        *lead, nb, k2, block, two = packed.shape
        return packed.transpose(-3, -2).reshape(*lead, nb * block, k2 * two)[..., :n, :]

    def moe_bf16(self, x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int,
                 norm_topk: bool, logical_to_physical: torch.Tensor, num_replicas: torch.Tensor,
                 load: torch.Tensor | None, gate_up: torch.Tensor, down: torch.Tensor,
                 intermediate: int, offset: int = 0) -> torch.Tensor:
        """MoE block output [T, H] for x [T, H]; the same contract as MoELayer's torch path.
        router, gate_up, down: packed (pack()) from [E, H], [P, 2I, H] and [P, H, I];
        int64 logical_to_physical [E, R], num_replicas [E] and load [E] (updated in place);
        offset: rotates which replica of an expert takes its extra token (the router's call
        count; see map_slots in cpu_bf16.c)."""
        x = x.contiguous()
        t, h = x.shape
        out = torch.empty_like(x)
        rc = self.lib.moed_moe_bf16(
            x.data_ptr(), t, h, router.data_ptr(), num_experts, top_k, int(norm_topk),
            logical_to_physical.data_ptr(), logical_to_physical.shape[1], num_replicas.data_ptr(),
            offset, None if load is None else load.data_ptr(),
            gate_up.data_ptr(), down.data_ptr(), gate_up.shape[0], intermediate, out.data_ptr(),
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_moe_bf16: " + ("out of memory" if rc == -1 else "expert map out of range"))
        return out

    def route_bf16(self, x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int,
                   norm_topk: bool, logical_to_physical: torch.Tensor, num_replicas: torch.Tensor,
                   load: torch.Tensor | None, num_physical: int,
                   offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_bf16's router half (expert parallelism): -> (physical slot [T, k] int64,
        weight [T, k] bf16) for x [T, H]; the same choices and weights moe_bf16 uses."""
        x = x.contiguous()
        t, h = x.shape
        phys = torch.empty((t, top_k), dtype=torch.long)
        wts = torch.empty((t, top_k), dtype=torch.float32)
        rc = self.lib.moed_route_bf16(
            x.data_ptr(), t, h, router.data_ptr(), num_experts, top_k, int(norm_topk),
            logical_to_physical.data_ptr(), logical_to_physical.shape[1], num_replicas.data_ptr(),
            offset, None if load is None else load.data_ptr(), num_physical, phys.data_ptr(),
            wts.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_route_bf16: " + ("out of memory" if rc == -1 else "expert map out of range"))
        return phys, wts.to(torch.bfloat16)     # exact: the kernel rounded them to bf16

    def experts_bf16(self, xs: torch.Tensor, counts: torch.Tensor | list[int], gate_up: torch.Tensor,
                     down: torch.Tensor, intermediate: int) -> torch.Tensor:
        """moe_bf16's expert half (expert parallelism): rows xs [R, H] grouped by local slot
        (counts [P] int64 rows per slot, in slot order) -> each row's expert output [R, H]
        bf16, unweighted. gate_up, down: packed [P, ...] as for moe_bf16."""
        xs, counts = xs.contiguous(), torch.as_tensor(counts, dtype=torch.long).contiguous()
        r, h = xs.shape
        out = torch.empty_like(xs)
        rc = self.lib.moed_experts_bf16(xs.data_ptr(), r, h, counts.data_ptr(), gate_up.data_ptr(),
                                        down.data_ptr(), gate_up.shape[0], intermediate,
                                        out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_experts_bf16: " + ("out of memory" if rc == -1 else "row counts do not add up"))
        return out

    def decode_attn_bf16(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one new token per sequence over its paged history -> [B, Hq, D].
        q [B, Hq, D] bf16 (heads and dims contiguous, rows may be strided); kv_layer one layer of
        a gqa KVLayout's cache, [num_blocks, 2, bs, Hkv, D] dense (K plane, then V plane, per
        block: the C code indexes it so); tables [B, max_blocks] and lens [B] int64."""
        b, hq, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        num_blocks, planes, bs, hkv, _ = kv_layer.shape
        if planes != 2:
            raise ValueError(f"decode_attn_bf16 reads a gqa KV layer [blocks, 2, bs, Hkv, D], "
                             f"got {tuple(kv_layer.shape)}")
        out = torch.empty((b, hq, d), dtype=q.dtype)
        rc = self.lib.moed_decode_attn_bf16(
            q.data_ptr(), q.stride(0), b, hq, hkv, d, kv_layer.data_ptr(), num_blocks, bs,
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale, out.data_ptr(),
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_decode_attn_bf16: " + ("out of memory" if rc == -1 else "bad shape or block id"))
        return out

    def prefill_attn_bf16(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                          scale: float) -> torch.Tensor:
        """Causal attention of n new tokens at positions start.. over all start + n keys -> [n, Hq, D].
        q [n, Hq, D] bf16 (heads and dims contiguous, rows may be strided); k, v [start + n, Hkv, D]
        (history then the new tokens; made contiguous). Rounding as torch's CPU flash attention."""
        n, hq, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d or q.stride(0) % 2:
            q = q.contiguous()
        k, v = k.contiguous(), v.contiguous()
        if k.shape != v.shape or k.shape[0] != start + n or k.shape[2] != d:
            raise ValueError(f"prefill_attn_bf16: k/v {tuple(k.shape)} for {n} tokens after {start}")
        out = torch.empty((n, hq, d), dtype=q.dtype)
        rc = self.lib.moed_prefill_attn_bf16(q.data_ptr(), q.stride(0), n, start, hq, k.shape[1], d,
                                             k.data_ptr(), v.data_ptr(), scale, out.data_ptr(),
                                             torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_prefill_attn_bf16: " + ("out of memory" if rc == -1 else "bad shape"))
        return out

    def rms_norm_bf16(self, h: torch.Tensor, weight: torch.Tensor, eps: float,
                      delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(h + delta) * weight, h + delta) for h [R, D] bf16 (delta may be None)."""
        h = h.contiguous()
        r, d = h.shape
        out = torch.empty_like(h)
        resid = h if delta is None else torch.empty_like(h)
        if delta is not None:
            delta = delta.contiguous()
        self.lib.moed_rms_norm_bf16(h.data_ptr(), None if delta is None else delta.data_ptr(),
                                    resid.data_ptr(), r, d, weight.data_ptr(), eps, out.data_ptr(),
                                    torch.get_num_threads())
        return out, resid

    def qk_norm_rope_bf16(self, qkv: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor | None,
                          eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm (weight [heads, D], or None for none) then rotary of the first
        `heads` heads of each qkv row [T, >= heads * D] -> [T, heads, D]; cos/sin [T, 1, D]."""
        t = qkv.shape[0]
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        if weight is not None:
            weight = weight.contiguous()
        out = torch.empty((t, heads, head_dim), dtype=qkv.dtype)
        self.lib.moed_qk_norm_rope_bf16(qkv.data_ptr(), t, qkv.stride(0), heads, head_dim,
                                        None if weight is None else weight.data_ptr(), eps,
                                        cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                        torch.get_num_threads())
        return out

    def fp8_to_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x.to(torch.bfloat16) for float8_e4m3fn x, the same values, by a table lookup."""
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self.lib.moed_lut_u8_to_u16(x.data_ptr(), x.numel(), self._fp8_lut.data_ptr(), out.data_ptr(),
                                    torch.get_num_threads())
        return out

    def argmax_f32(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) of fp32 x [B, V] (first index on ties, a NaN wins), int64 [B]."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.lib.moed_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out

    def linear_bf16(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] @ W^T (+ bias) -> [R, n] bf16, W given packed (pack()) from [n, K]."""
        x = x.contiguous()
        r, k = x.shape
        out = torch.empty((r, n), dtype=x.dtype)
        rc = self.lib.moed_linear_bf16(x.data_ptr(), r, k, packed.data_ptr(), n,
                                       None if bias is None else bias.data_ptr(), out.data_ptr(),
                                       torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_linear_bf16: out of memory")
        return out


def enabled_by_env() -> bool:
    return os.environ.get("MOED_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


def isa_missing(isa: str) -> str:
    """Why this CPU cannot run variant `isa` ('' if it can)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are x86-64 Linux only, this is {platform.system()}/{platform.machine()}"
    lacks = sorted(ISA_NEEDS[isa] - cpu_flags())
    return f"CPU lacks {', '.join(lacks)}" if lacks else ""


def runnable_isas() -> list[str]:
    """The variants this CPU runs, fastest first."""
    return [isa for isa in ISAS if not isa_missing(isa)]


def best_isa() -> str | None:
    return next(iter(runnable_isas()), None)


def cpu_flags_ok() -> bool:
    """Whether some variant runs here. Checked before loading a .so: its code may use its
    instructions anywhere, even in the probe."""
    return best_isa() is not None


def isa_from_env() -> str | None:
    """The variant MOED_CPU_ISA asks for (auto or unset: the fastest this CPU runs; None: none
    runs). Raises IsaRefused for a name that is no variant or one this CPU cannot run."""
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if want in ("", "auto"):
        return best_isa()
    if want not in ISA_CFLAGS:
        extra = " (no AMX variant is built yet)" if want == "amx" else ""
        raise IsaRefused(f"{ISA_ENV}={want!r} names no kernel variant{extra}; "
                         f"use auto, {', '.join(ISAS)}")
    if why := isa_missing(want):
        raise IsaRefused(f"{ISA_ENV}={want}: this CPU cannot run it ({why}); "
                         f"it runs: {', '.join(runnable_isas()) or 'none'}")
    return want


@functools.cache
def load(isa: str) -> CpuKernels:
    """Variant `isa`, built if needed and loaded (once per process). Raises KernelUnavailable
    (or OSError) with why; never loads a variant this CPU cannot run."""
    if why := isa_missing(isa):
        raise KernelUnavailable(f"this CPU cannot run the {isa} kernels ({why})")
    return CpuKernels(build(isa=isa), isa)


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels of the variant MOED_CPU_ISA picks, or None (logged once, with why) when
    they cannot run here. IsaRefused (a bad MOED_CPU_ISA) propagates."""
    if not enabled_by_env():
        log.info("cpu_kernels_off", reason="MOED_CPU_KERNELS=0")
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        log.info("cpu_kernels_off", reason=f"not built for {platform.system()}/{platform.machine()}")
        return None
    isa = isa_from_env()
    if isa is None:
        log.info("cpu_kernels_off", reason="CPU lacks AVX2+FMA and AVX512", fallback="torch")
        return None
    try:
        k = load(isa)
    except (KernelUnavailable, OSError) as e:
        log.warning("cpu_kernels_off", reason=str(e), fallback="torch")
        return None
    forced = os.environ.get(ISA_ENV, "").strip().lower() not in ("", "auto")
    log.info("cpu_kernels_on", path=str(k.path), isa=isa, forced=forced, same_bits_all_variants=k.dot_order_ok)
    return k
