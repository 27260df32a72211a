"""Mamba-2 (Dao & Gu, 2024, "Transformers are SSMs") as plain nn.Modules, in the paper's vocabulary.

Shapes: b batch, L sequence length, d ``d_model``, E = ``expand`` d the inner width, H heads of P = ``headdim``
channels (H P = E), G groups of the SSM's B and C (each shared by R = H / G heads), N ``d_state``, Q the chunk length,
W ``d_conv``. (The batch is written ``b`` to keep it apart from the SSM's input matrix B.)

The selective state space model with a scalar-times-identity state matrix, per head and time step t:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        h_t [P, N], x_t [P], B_t, C_t [N], A < 0 a scalar per head
    y_t = h_t C_t + D x_t

**The state space dual (SSD)**: over a sequence this is y = M x with M[t, s] = C_t^T B_s dt_s exp(a_{s+1} + .. + a_t)
(a = dt A), a semiseparable matrix. :func:`ssd_chunked` cuts the sequence into chunks of Q steps: inside a chunk, the
quadratic (attention-like) form with the decay mask exp(segsum(a)); between chunks, each chunk's final state is
passed on by the recurrence S_c = exp(sum of a over chunk c) S_{c-1} + (state made inside chunk c), one step per
chunk, so the whole is linear in L (O(L Q (N + P) + L N P) per head). The reference's dense [chunks x chunks] decay
matrix, quadratic in the number of chunks, is not used. :func:`ssd_recurrent` is the same model step by step
(:func:`ssd_step`, both in :mod:`foxhunt.kernels.ssd_recurrence`), the ground truth of the tests and of
:meth:`Mamba2Block.step`. On the CPU a block runs the recurrence in compiled C loops instead
(:mod:`foxhunt.kernels.mamba2_block`, ``native=True``).

**The block** (:class:`Mamba2Block`, the paper's parallel Mamba-2 block): one input projection to (z, x, B, C, dt);
a short causal depthwise convolution and SiLU over (x, B, C); dt = softplus(dt + dt_bias), clamped to ``dt_limit``;
A = -exp(A_log); the SSD with the D skip; the gated RMSNorm norm(y * silu(z)); the output projection.
:class:`Mamba2Stack` stacks them as pre-norm residual blocks (h + block(RMSNorm(h))) with a final RMSNorm;
:class:`Mamba2Forecaster` reads the market's windows with it.

Everything is causal by construction: the convolution is padded on the left only, the chunked scan is the lower
triangular M, and no normalisation mixes time steps.

Precision: the scan runs in float32 with autocast off whatever the input dtype (a bf16 state or decay would drift), and
its output returns in the input's dtype. With ``use_kernels=True``, CUDA tensors and ``mamba_ssm`` importable
(``pip install foxhunt[cuda]``), the scan runs in its fused Triton kernel (``mamba_chunk_scan_combined``) instead;
the parameters are the same, so a state dict loads either way.
"""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foxhunt.kernels import mamba2_block
from foxhunt.kernels.ssd_recurrence import ssd_recurrent as ssd_recurrent  # re-exported: the scans' ground truth
from foxhunt.kernels.ssd_recurrence import ssd_step
from foxhunt.models.linear_skip import LinearSkip, add_skip

try:  # optional fast path (CUDA only): the fused SSD kernel of the reference implementation
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except Exception:  # noqa: BLE001 - absent, or present without a working CUDA/Triton stack
    mamba_chunk_scan_combined = None


def kernels_available() -> bool:
    """Whether ``mamba_ssm``'s fused SSD kernel could be imported (it still needs CUDA tensors)."""
    return mamba_chunk_scan_combined is not None


def _up(t: Tensor) -> Tensor:
    """The tensor in float32, or float64 if it is float64 (what the scan, dt and the norms compute in)."""
    return t if t.dtype == torch.float64 else t.float()


# ---------------------------------------------------------------------------------------------------- the SSD scan
def segsum(a_cum: Tensor) -> Tensor:
    """Segment sums [..., T, T] from the prefix sums a_cum [..., T] of a: out[i, j] = a[j+1] + .. + a[i]
    = a_cum[i] - a_cum[j] for i >= j (0 on the diagonal), -inf above it. exp(segsum) is a chunk's decay mask
    (:func:`decay_mask`).

    As a difference of prefix sums it costs one pass and its backward two reductions, not a cumulative sum over
    [T, T]; the price is a rounding of eps * |a_cum| on the exponent (about 1e-6 relative on the decay for a chunk
    of 64 steps of |dt A| <= 1.6, the initial range), which the tests hold against the step-by-step recurrence.
    """
    t = a_cum.shape[-1]
    rows = torch.arange(t, device=a_cum.device)
    return (a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(rows[:, None] < rows[None, :], -math.inf)


def decay_mask(a_cum: Tensor) -> Tensor:
    """[..., T, T] exp(a[j+1] + .. + a[i]) for i >= j, 0 above the diagonal: how much of step j is left at step i."""
    return segsum(a_cum).exp()


def _chunk_length(length: int, chunk_size: int) -> int:
    """The chunk length actually used: as many chunks as ``chunk_size`` needs, each as short as they can be (so a
    sequence of 70 with chunk_size 64 is two chunks of 35, not 128 steps of which 58 are padding)."""
    n_chunks = -(-length // chunk_size)
    return -(-length // n_chunks)


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The SSD layer in its chunked dual form (see the module docstring), pure PyTorch on any device.

    Args:
        x: [b, L, H, P] inputs.
        dt: [b, L, H] step sizes (after softplus and limits), > 0.
        A: [H] state matrices (scalar times identity), < 0.
        B, C: [b, L, G, N] input and output matrices; head h reads group h // (H / G).
        chunk_size: longest chunk Q; any L works (the last chunk is padded with dt = 0, which changes nothing).
        D: [H] skip, y += D x.
        initial_state: [b, H, P, N] state before the first step (zeros if None).
        return_final_state: also return the state after the last step, [b, H, P, N].

    Returns y [b, L, H, P] in x's dtype (computed in float32, or float64 for float64 inputs), and the final state
    (in the computing dtype) if asked for.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, length, n_heads, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if n_heads % g:
        raise ValueError(f"{n_heads} heads cannot share {g} groups of B and C")
    r = n_heads // g
    out_dtype = x.dtype
    work = _up(x).dtype
    with torch.autocast(x.device.type, enabled=False):
        x, dt, A, B, C = (t.to(work) for t in (x, dt, A, B, C))
        q = _chunk_length(length, chunk_size)
        pad = (-length) % q
        if pad:  # dt = 0 past the end: decay 1 and no input, so the padded steps change neither y nor the state
            x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
            dt = F.pad(dt, (0, 0, 0, pad))
        c = (length + pad) // q
        # [b, G, R, c, Q, *]: batched matrix products over (batch, group, head, chunk)
        xdt = (x * dt[..., None]).view(b, c, q, g, r, p).permute(0, 3, 4, 1, 2, 5)  # discretised input dt x
        a = (dt * A).view(b, c, q, g, r).permute(0, 3, 4, 1, 2)  # log decay of each step, <= 0
        Bc = B.view(b, c, q, g, 1, n).permute(0, 3, 4, 1, 2, 5)
        Cc = C.view(b, c, q, g, 1, n).permute(0, 3, 4, 1, 2, 5)
        a_cum = a.cumsum(-1)  # decay from the chunk's start through step q
        # 1. inside each chunk: the quadratic form (C B^T * exp(segsum a)) (dt x); C B^T is shared by a group's heads
        y = ((Cc @ Bc.transpose(-1, -2)) * decay_mask(a_cum)) @ xdt
        # 2. the state each chunk makes from its own inputs, at its end: sum_s exp(a after s) (dt x)_s B_s^T; only
        #    for the chunks whose state is read (by a later chunk, or by the caller for the last one)
        passed = c if return_final_state else c - 1
        own = ((xdt[:, :, :, :passed] * (a_cum[..., :passed, -1:] - a_cum[..., :passed, :]).exp()[..., None])
               .transpose(-1, -2) @ Bc[:, :, :, :passed])  # [b, G, R, passed, P, N]
        decay = a_cum[..., :passed, -1, None, None].exp()  # [b, G, R, passed, 1, 1] the whole chunk's decay
        # 3. states passed between chunks: one recurrence step per chunk, linear in the number of chunks (unbind,
        #    not indexing: the backward of c slices would build c gradients of the whole tensor)
        state = None if initial_state is None else initial_state.to(work).reshape(b, g, r, p, n)
        entering = []
        for decay_i, own_i in zip(decay.unbind(3), own.unbind(3), strict=True):
            entering.append(state)
            state = own_i if state is None else decay_i * state + own_i
        entering += [state] * (c - passed)
        # 4. what the entering state adds to each step: exp(a through q) C_q^T S (nothing enters chunk 0 from zeros)
        first = 0 if initial_state is not None else 1
        if c > first:
            states = torch.stack(entering[first:], 3).transpose(-1, -2)  # [b, G, R, c - first, N, P]
            y_off = (Cc[:, :, :, first:] @ states) * a_cum[..., first:, :].exp()[..., None]
            y = y + y_off if first == 0 else torch.cat([y[:, :, :, :1], y[:, :, :, 1:] + y_off], 3)
        y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, c * q, n_heads, p)[:, :length]
        if D is not None:
            y = y + D.to(work)[:, None] * x[:, :length]
        if state is None:
            state = x.new_zeros(b, g, r, p, n)
    y = y.to(out_dtype)
    if return_final_state:
        return y, state.reshape(b, n_heads, p, n)
    return y


# --------------------------------------------------------------------------------------------------------- the block
def _last_conv_inputs(past: Tensor | None, xbc: Tensor, n: int) -> Tensor:
    """The last n inputs of the convolution, [b, channels, n] (the next call's past): from xbc [b, L, channels], and
    from past [b, n, channels] (None: zeros) where L < n."""
    if xbc.shape[1] < n:
        xbc = torch.cat([xbc.new_zeros(xbc.shape[0], n, xbc.shape[2]) if past is None else past, xbc], 1)
    return xbc[:, xbc.shape[1] - n :].transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """norm(y * silu(z)) * weight: the block's gate folded into its extra normalisation (float32 inside)."""

    no_decay_params = ("weight",)

    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, y: Tensor, z: Tensor, lib: ctypes.CDLL | None = None) -> Tensor:
        """``lib``: the block's compiled loops, which compute the same in one pass (float32)."""
        if lib is not None:
            return mamba2_block.rms_norm(lib, y, z, self.weight, self.eps)
        gated = _up(y) * F.silu(_up(z))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * _up(self.weight)).to(y.dtype)


class Mamba2State(NamedTuple):
    """A block's recurrent state: the last W - 1 inputs of the convolution and the SSM state."""

    conv: Tensor  # [b, E + 2 G N, W - 1]
    ssm: Tensor  # [b, H, P, N], float32 (float64 in a float64 block)


class Mamba2Block(nn.Module):
    """The Mamba-2 block: in_proj -> (z, x, B, C, dt); causal conv1d + SiLU over (x, B, C); SSD; norm(y * silu(z));
    out_proj. Input and output [b, L, d].

    ``forward`` runs the chunked (parallel) form; :meth:`step` one time step with a :class:`Mamba2State`, giving the
    same outputs bar by bar. ``forward(u, state, return_state=True)`` continues from a state and returns the next one,
    so a prefix can run in parallel and the rest step by step.
    """

    no_decay_params = ("A_log", "D", "dt_bias")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        d_conv: int = 4,
        expand: int = 2,
        headdim: int = 64,
        ngroups: int = 1,
        chunk_size: int = 64,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] | None = None,
        bias: bool = False,
        conv_bias: bool = True,
        use_kernels: bool = False,
        native: bool = True,
    ) -> None:
        """
        Args:
            d_model: width d of the block's input and output.
            d_state: SSM state size N per channel.
            d_conv: width W of the causal depthwise convolution.
            expand: inner width E = expand * d_model.
            headdim: channels per head P (E must divide by it).
            ngroups: groups G of B and C shared by heads (H must divide by it).
            chunk_size: longest chunk of the SSD scan (outputs do not depend on it).
            A_init_range: A = -U(range) at initialisation (A_log = log of it).
            dt_min, dt_max: dt at initialisation is log-uniform in [dt_min, dt_max] (softplus(dt_bias) = dt).
            dt_init_floor: smallest dt at initialisation.
            dt_limit: clamp softplus(dt + dt_bias) into [lo, hi]; None: no clamp.
            bias: biases in the input and output projections.
            conv_bias: bias in the convolution.
            use_kernels: on CUDA tensors, run the scan with mamba_ssm's fused kernel when it is installed.
            native: on CPU tensors (not float64), run the convolution with its SiLU, the SSD and the norms in
                foxhunt's compiled C loops (:mod:`foxhunt.kernels.mamba2_block`, the SSD step by step) where a C
                compiler is available; elsewhere, or False, the plain PyTorch block (:func:`ssd_chunked`). Same
                parameters and outputs (to float32 rounding).
        """
        super().__init__()
        d_inner = expand * d_model
        if min(d_model, d_state, d_conv, expand, headdim, ngroups, chunk_size) < 1:
            raise ValueError("d_model, d_state, d_conv, expand, headdim, ngroups and chunk_size must all be >= 1")
        if d_inner % headdim:
            raise ValueError(f"the inner width expand * d_model = {d_inner} must divide by headdim = {headdim}")
        n_heads = d_inner // headdim
        if n_heads % ngroups:
            raise ValueError(f"{n_heads} heads cannot be split into ngroups = {ngroups} groups")
        if not 0.0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"A_init_range must be 0 < lo <= hi, got {A_init_range}")
        if not 0.0 < dt_min <= dt_max:
            raise ValueError(f"dt_min and dt_max must be 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        if dt_limit is not None and not 0.0 <= dt_limit[0] < dt_limit[1]:
            raise ValueError(f"dt_limit must be 0 <= lo < hi, got {dt_limit}")
        self.d_model, self.d_state, self.d_conv, self.d_inner = d_model, d_state, d_conv, d_inner
        self.headdim, self.n_heads, self.ngroups, self.chunk_size = headdim, n_heads, ngroups, chunk_size
        self.dt_limit = None if dt_limit is None else (float(dt_limit[0]), float(dt_limit[1]))
        self.use_kernels, self.native = use_kernels, native
        self.conv_dim = d_inner + 2 * ngroups * d_state
        self.native_shape = mamba2_block.BlockShape(n_heads, headdim, ngroups, d_state, self.conv_dim, d_conv,
                                                     d_model)
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * ngroups * d_state + n_heads, bias=bias)  # z, x, B, C, dt
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias)
        # dt_bias: softplus(dt_bias) log-uniform in [dt_min, dt_max] (the inverse of softplus: dt + log(1 - exp(-dt)))
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp_min(dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(*A_init_range).log())
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(d_inner)
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)

    # ------------------------------------------------------------------------------------------------ pieces
    @property
    def split_sizes(self) -> list[int]:
        """Widths of the input projection's outputs: z, (x, B, C), dt."""
        return [self.d_inner, self.conv_dim, self.n_heads]

    def _split(self, zxbcdt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """z [.., E], (x, B, C) [.., E + 2 G N], dt [.., H] (one split: its backward is a cat, not three zero fills)."""
        z, xbc, dt = zxbcdt.split(self.split_sizes, -1)
        return z, xbc, dt

    def _dt(self, dt: Tensor) -> Tensor:
        dt = F.softplus(_up(dt) + _up(self.dt_bias))
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        return dt

    def _heads(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(x, B, C) of the convolved channels: [..., H, P], [..., G, N], [..., G, N]."""
        gn = self.ngroups * self.d_state
        lead = xbc.shape[:-1]
        x, B, C = xbc.split([self.d_inner, gn, gn], -1)
        return (x.reshape(*lead, self.n_heads, self.headdim), B.reshape(*lead, self.ngroups, self.d_state),
                C.reshape(*lead, self.ngroups, self.d_state))

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Mamba2State:
        """The state before the first step: zeros."""
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        ssm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return Mamba2State(
            torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype),
            torch.zeros(batch_size, self.n_heads, self.headdim, self.d_state, device=device, dtype=ssm_dtype),
        )

    @torch.compiler.disable  # a cached lookup (and on first use a build): outside torch.compile's graphs
    def native_library(self, u: Tensor) -> ctypes.CDLL | None:
        """The compiled CPU loops for this block's shape when they apply to ``u`` (``native`` on, a CPU tensor that is
        not float64, a C compiler here), else None."""
        if not self.native or u.device.type != "cpu" or u.dtype == torch.float64:
            return None
        return mamba2_block.library(self.native_shape)

    def ssd(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial: Tensor | None,
            return_state: bool) -> Tensor | tuple[Tensor, Tensor]:
        """The SSD with the D skip (shapes as :func:`ssd_chunked`): the CUDA kernel when asked for and usable, else
        the pure-PyTorch chunked scan."""
        if self.use_kernels and x.is_cuda and mamba_chunk_scan_combined is not None:
            return mamba_chunk_scan_combined(x, dt, A, B, C, self.chunk_size, D=_up(self.D),
                                             initial_states=initial, return_final_states=return_state)
        return ssd_chunked(x, dt, A, B, C, self.chunk_size, D=self.D, initial_state=initial,
                                return_final_state=return_state)

    # ------------------------------------------------------------------------------------------------ parallel
    def forward(
        self, u: Tensor, state: Mamba2State | None = None, return_state: bool = False, tail: int | None = None
    ) -> Tensor | tuple[Tensor, Mamba2State]:
        """[b, L, d] -> [b, L, d], every step at once (continuing from ``state`` if given).

        ``tail``: return only the last ``tail`` steps' outputs [b, tail, d] (the scan still runs over every step; the
        gate, norm and output projection of the others, which nothing would read, are skipped, and so are the scan's
        outputs there on the compiled path).
        """
        b, length, _ = u.shape
        lib = self.native_library(u)
        if lib is not None:  # three products (no strided slices for the C loops), the gate z only where read
            proj = self.in_proj
            biases = (None,) * 3 if proj.bias is None else proj.bias.split(self.split_sizes)
            rows = (u if tail is None else u[:, length - tail :], u, u)
            z, xbc, dt = (F.linear(r, w, bi) for r, w, bi in zip(rows, proj.weight.split(self.split_sizes), biases,
                                                                  strict=True))
            past = state.conv.transpose(1, 2).to(xbc.dtype) if state is not None else None  # [b, W - 1, channels]
            conv = mamba2_block.conv_silu(lib, past, xbc, self.conv1d.weight, self.conv1d.bias)  # past, xbc in place
            last_inputs = _last_conv_inputs(past, xbc, self.d_conv - 1)
        else:
            z, xbc, dt = self._split(self.in_proj(u))
            xbc = xbc.transpose(1, 2)  # [b, channels, L]
            past = state.conv.to(xbc.dtype) if state is not None else xbc.new_zeros(b, self.conv_dim, self.d_conv - 1)
            padded = torch.cat([past, xbc], 2)  # causal: the kernel sees only the W - 1 steps before each step
            conv = F.conv1d(padded, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
            conv = F.silu(conv).transpose(1, 2)
            last_inputs = padded[..., padded.shape[-1] - (self.d_conv - 1) :]
        dt, A = self._dt(dt), -torch.exp(_up(self.A_log))
        initial = state.ssm if state is not None else None
        if lib is not None:  # with tail: only the last steps' outputs are computed
            y, final = mamba2_block.ssd(lib, self.native_shape, conv, dt, A, self.D, initial, self.chunk_size, tail)
        else:
            x, B, C = self._heads(conv)
            out = self.ssd(x, dt, A, B, C, initial, return_state)
            y, final = out if return_state else (out, None)
        y = y.reshape(b, y.shape[1], self.d_inner)
        if tail is not None:
            y, z = y[:, y.shape[1] - tail :], z[:, z.shape[1] - tail :]
        y = self.out_proj(self.norm(y, z, lib))
        if not return_state:
            return y
        return y, Mamba2State(last_inputs, _up(final))

    # ------------------------------------------------------------------------------------------------ recurrent
    def step(self, u: Tensor, state: Mamba2State) -> tuple[Tensor, Mamba2State]:
        """One time step: u [b, d] and the state before it -> output [b, d] and the state after it."""
        z, xbc, dt = self._split(self.in_proj(u))
        window = torch.cat([state.conv.to(xbc.dtype), xbc[..., None]], 2)  # [b, channels, W]
        conv = (window * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, B, C = self._heads(F.silu(conv))
        dt, A = self._dt(dt), -torch.exp(_up(self.A_log))
        y, ssm = ssd_step(_up(state.ssm), _up(x), dt, A, _up(B), _up(C), _up(self.D))
        y = self.out_proj(self.norm(y.to(u.dtype).reshape(u.shape[0], self.d_inner), z))
        return y, Mamba2State(window[..., 1:], ssm)


# --------------------------------------------------------------------------------------------------------- the stack
def rms_norm(norm: nn.RMSNorm, h: Tensor, lib: ctypes.CDLL | None) -> Tensor:
    """``norm(h)``, in the block's compiled loops when they are given (one pass, float32)."""
    if lib is None:
        return norm(h)
    eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps  # (nn.RMSNorm's default)
    return mamba2_block.rms_norm(lib, h, None, norm.weight, eps)


class ResidualBlock(nn.Module):
    """Pre-norm residual: h + dropout(Mamba2Block(RMSNorm(h)))."""

    def __init__(self, d_model: int, dropout: float = 0.0, **block: object) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.mixer = Mamba2Block(d_model, **block)  # type: ignore[arg-type]
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, h: Tensor, state: Mamba2State | None = None, return_state: bool = False, tail: int | None = None
    ) -> Tensor | tuple[Tensor, Mamba2State]:
        out = self.mixer(rms_norm(self.norm, h, self.mixer.native_library(h)), state, return_state, tail)
        if tail is not None:
            h = h[:, h.shape[1] - tail :]
        if return_state:
            return h + self.dropout(out[0]), out[1]
        return h + self.dropout(out)

    def step(self, h: Tensor, state: Mamba2State) -> tuple[Tensor, Mamba2State]:
        out, state = self.mixer.step(self.norm(h), state)
        return h + self.dropout(out), state


class Mamba2Stack(nn.Module):
    """``n_layers`` residual Mamba-2 blocks and a final RMSNorm: [b, L, d] -> [b, L, d].

    The output projections start scaled by 1 / sqrt(n_layers), so the residual stream's variance does not grow with
    depth at initialisation (as GPT-2 and the Mamba reference do).
    """

    def __init__(self, d_model: int, n_layers: int = 2, dropout: float = 0.0, **block: object) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.layers = nn.ModuleList(ResidualBlock(d_model, dropout, **block) for _ in range(n_layers))
        self.norm_f = nn.RMSNorm(d_model, eps=1e-5)
        with torch.no_grad():
            for layer in self.layers:
                layer.mixer.out_proj.weight /= math.sqrt(n_layers)

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> list[Mamba2State]:
        return [layer.mixer.init_state(batch_size, device) for layer in self.layers]

    def forward(
        self, h: Tensor, states: list[Mamba2State] | None = None, return_state: bool = False, tail: int | None = None
    ) -> Tensor | tuple[Tensor, list[Mamba2State]]:
        """``tail``: only the last ``tail`` steps' outputs [b, tail, d] (the last layer skips the others' outputs)."""
        if tail is not None and not 1 <= tail <= h.shape[1]:
            raise ValueError(f"tail must be in [1, {h.shape[1]}], got {tail}")
        new_states = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            out = layer(h, None if states is None else states[i], return_state, tail if i == last else None)
            h = out[0] if return_state else out
            if return_state:
                new_states.append(out[1])
        h = rms_norm(self.norm_f, h, self.layers[-1].mixer.native_library(h))
        return (h, new_states) if return_state else h

    def step(self, h: Tensor, states: list[Mamba2State]) -> tuple[Tensor, list[Mamba2State]]:
        """One time step h [b, d] through every layer."""
        new_states = []
        for layer, state in zip(self.layers, states, strict=True):
            h, state = layer.step(h, state)
            new_states.append(state)
        return self.norm_f(h), new_states


# ---------------------------------------------------------------------------------------------------- the forecaster
class Mamba2Output(NamedTuple):
    """What the forecaster returns (a named tuple, like the TFT's, so members read ``.prediction``)."""

    prediction: Tensor  # [b, H, Q] quantiles of the H targets


class Mamba2Forecaster(nn.Module):
    """Quantile forecasts of the next ``horizon`` targets from a window of past features and the known-future inputs.

    The sequence is the L past rows followed by H decoder rows (the paper's language model reads a sequence; here
    the decoder rows are the steps whose targets are forecast):

    - past row s (bar t-L+1+s): all F features, and a decoder indicator 0;
    - decoder row h (bar t+1+h): the K known-future features in their own columns, zeros in the F - K columns not
      known in advance, and a decoder indicator 1.

    One linear map embeds both (``input_proj`` [d, F + 1]; the decoder rows use only its known-future columns and the
    indicator's, so no zero matrix is built), the symbol's embedding is added to every row, the stack runs causally,
    and ``quantile_head`` reads the H decoder rows' outputs. Decoder row h sees the past and the known-future rows
    up to h only: nothing after bar t of the unknown features, nothing after bar t+1+h of the known ones.
    ``linear_skip`` adds a linear quantile regression on the decision row's inputs to the output
    (:class:`~foxhunt.models.linear_skip.LinearSkip`, zero at initialisation): the direct path to a weak signal.
    """

    def __init__(
        self,
        n_features: int,
        known_future_index: list[int] | tuple[int, ...] = (),
        n_symbols: int = 1,
        horizon: int = 6,
        d_model: int = 32,
        n_layers: int = 2,
        n_quantiles: int = 3,
        dropout: float = 0.0,
        linear_skip: bool = False,
        **block: object,
    ) -> None:
        super().__init__()
        if n_features < 1 or n_symbols < 1 or horizon < 1 or n_quantiles < 1:
            raise ValueError("n_features, n_symbols, horizon and n_quantiles must all be >= 1")
        known = [int(i) for i in known_future_index]
        if any(not 0 <= i < n_features for i in known) or len(set(known)) != len(known):
            raise ValueError(f"known_future_index must be distinct feature columns in [0, {n_features}), got {known}")
        self.n_features, self.n_known_future, self.n_symbols, self.horizon = n_features, len(known), n_symbols, horizon
        self.register_buffer("known_future_index", torch.tensor(known, dtype=torch.long), persistent=False)
        self.input_proj = nn.Linear(n_features + 1, d_model)  # the F features and the decoder indicator
        self.symbol_embedding = nn.Embedding(n_symbols, d_model)
        self.backbone = Mamba2Stack(d_model, n_layers, dropout, **block)
        self.quantile_head = nn.Linear(d_model, n_quantiles)
        # the decision row's inputs straight to the quantiles (models/linear_skip.py), zero at initialisation
        self.linear_skip = LinearSkip(n_features, horizon, n_quantiles) if linear_skip else None

    def embed(self, x_past: Tensor, x_future: Tensor | None, symbol: Tensor | None) -> Tensor:
        """[b, L + H, d]: the past rows, then the decoder rows (see the class docstring)."""
        b = x_past.shape[0]
        w, bias = self.input_proj.weight, self.input_proj.bias
        past = F.linear(x_past, w[:, : self.n_features], bias)
        if self.n_known_future:
            if x_future is None or x_future.shape[-1] != self.n_known_future:
                raise ValueError(f"x_future must be [b, {self.horizon}, {self.n_known_future}] known-future inputs")
            future = F.linear(x_future, w[:, self.known_future_index], bias + w[:, self.n_features])
        else:
            future = (bias + w[:, self.n_features]).expand(b, self.horizon, -1)
        h = torch.cat([past, future.to(past.dtype)], 1)
        if symbol is not None:
            h = h + self.symbol_embedding(symbol)[:, None, :]
        return h

    def forward(self, x_past: Tensor, x_future: Tensor | None = None, symbol: Tensor | None = None) -> Mamba2Output:
        """x_past [b, L, F], x_future [b, H, K], symbol [b] -> quantiles [b, H, Q]."""
        h = self.backbone(self.embed(x_past, x_future, symbol), tail=self.horizon)  # the decoder rows only
        return Mamba2Output(add_skip(self.quantile_head(h), self.linear_skip, x_past))
