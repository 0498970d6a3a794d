"""PerceptionNet v1 in PyTorch: an independent reference of shared/spec/MODEL.md.

Written from the contract alone (not from the C++ engine), so that its autograd can check the
engine's hand-written gradients and it can serve as the performance peer on a CUDA host.

* Parameter and buffer names are the checkpoint keys of MODEL.md §4, so
  `model.load_state_dict(safetensors.torch.load_file(path), strict=False)` loads a checkpoint
  (the `optim.*` keys are the only unexpected ones); `load_checkpoint` does that and restores the
  AdamW moments and step into `torch.optim.AdamW` as well.
* The SSM over a window runs in the chunked SSD form of Mamba2 (segment sums inside chunks,
  state passing between chunks), with initial and final states; `ssm_scan` is the plain
  sequential recurrence, kept only to check it.
* The causal conv is `F.conv1d(groups=channels)` over [carried state ; window].
* The CfC is a loop over time (it is a true recurrence); the parts that do not depend on the
  carried state (the backbone's input projection) are hoisted out of the loop.
* The GRN head runs batched over every (batch, time) position.
* `step` runs one event per stream with explicit state (MODEL.md §3).

Weight decay (MODEL.md §4) applies exactly to the 2-D `.weight` matrices: every Linear weight
(embed, in_proj, out_proj, the CfC and GRN matrices, head.out). Biases, norm weights, the depthwise
conv kernel [C,1,W], dt_bias, A_log and D are not decayed. `param_groups` builds the groups.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

RMS_EPS = 1e-5  # MODEL.md §2.2.1 and §2.2.6
LN_EPS = 1e-5  # MODEL.md §2.5
LECUN_SCALE, LECUN_SLOPE = 1.7159, 0.666  # MODEL.md §2.4
CHECKPOINT_FORMAT = "perception-v1"  # MODEL.md §6


# ---------------------------------------------------------------------------------------------
# Configuration (MODEL.md §7)


@dataclass
class ModelConfig:
    n_features: int = 40  # F
    d_model: int = 128  # D
    n_layers: int = 2  # L
    expand: int = 2
    headdim: int = 64  # P
    d_state: int = 32  # N
    d_conv: int = 4  # W
    cfc_units: int = 64  # C
    cfc_backbone: int = 128  # K
    grn_hidden: int = 64  # G
    n_horizons: int = 5  # H
    horizons: List[int] = field(default_factory=lambda: [10, 20, 50, 100, 200])
    window: int = 64  # T
    batch: int = 256  # B
    warmup: int = 16

    @property
    def d_inner(self) -> int:  # E
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:  # Hh
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:  # E + 2N
        return self.d_inner + 2 * self.d_state

    @property
    def in_proj_dim(self) -> int:  # 2E + 2N + Hh
        return 2 * self.d_inner + 2 * self.d_state + self.n_heads

    @property
    def head_input(self) -> int:  # D + C
        return self.d_model + self.cfc_units

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and f.name != "warmup" and v <= 0:
                raise ValueError(f"config: {f.name} must be positive, got {v}")
        if self.d_inner % self.headdim:
            raise ValueError(f"config: d_inner {self.d_inner} not divisible by headdim {self.headdim}")
        if len(self.horizons) != self.n_horizons:
            raise ValueError("config: horizons must have n_horizons entries")

    @staticmethod
    def from_json(text: str) -> "ModelConfig":
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        c = ModelConfig(**{k: v for k, v in d.items() if k in names})
        c.validate()
        return c

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def named_config(name: str) -> ModelConfig:
    if name in ("small", "default"):
        return ModelConfig()
    if name == "tiny":
        return ModelConfig(n_features=6, d_model=8, n_layers=2, expand=2, headdim=4, d_state=3, d_conv=4,
                           cfc_units=5, cfc_backbone=7, grn_hidden=6, n_horizons=3, horizons=[10, 20, 50],
                           window=9, batch=2, warmup=2)
    if name == "large":
        return ModelConfig(n_features=48, d_model=512, n_layers=4, expand=2, headdim=64, d_state=64, d_conv=4,
                           cfc_units=128, cfc_backbone=256, grn_hidden=128, n_horizons=5,
                           horizons=[10, 20, 50, 100, 200], window=256, batch=64, warmup=16)
    raise ValueError(f"unknown config '{name}' (known: tiny, small, large)")


# ---------------------------------------------------------------------------------------------
# The SSM: chunked SSD form (used by the model) and the sequential scan (used to check it)


def segsum(x: Tensor) -> Tensor:
    """Stable segment sums: out[..., i, j] = sum_{k=j+1..i} x[..., k] for j <= i, -inf above the diagonal.

    exp(segsum(a)) is the lower-triangular matrix of decays exp(a_{j+1} + ... + a_i) (1 on the diagonal).
    Summing inside the masked cumsum, instead of differencing two cumsums, keeps it exact in float32.
    """
    T = x.size(-1)
    x = x.unsqueeze(-1).expand(*x.shape, T)  # [..., i(k), j]
    strictly_lower = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)
    x = x.masked_fill(~strictly_lower, 0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(0)
    return out.masked_fill(~lower, -math.inf)


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int = 64,
                initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The selective SSM of MODEL.md §2.2.5 (without the D skip) in Mamba2's chunked SSD form.

    x [b,T,h,p] (xs), dt [b,T,h] (after softplus), A [h] (negative), B, C [b,T,n] (one group, shared
    by all heads), initial_state [b,h,p,n] or None (zero). Returns y [b,T,h,p] with
    y_t = Σ_n C_t[n] s_t[h,p,n] and the final state s_T [b,h,p,n], where
    s_t = exp(dt_t A) s_{t-1} + (dt_t x_t) ⊗ B_t.
    Inside a chunk of length Q the output is a masked (Q×Q) matrix product (the "attention" form);
    each chunk's end state is computed in parallel, and the states are passed between chunks. T need not be a multiple of Q: the tail is padded with dt = 0 and x = 0,
    which neither decays nor feeds the state, so the final state is exact.
    """
    b, T, h, p = x.shape
    n = B.shape[-1]
    Q = max(1, min(chunk, T))
    pad = (-T) % Q
    xd = x * dt.unsqueeze(-1)  # dt ⊙ x
    a = dt * A  # [b,T,h], the log-decay per step
    if pad:
        xd = F.pad(xd, (0, 0, 0, 0, 0, pad))
        a = F.pad(a, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, pad))
    c = (T + pad) // Q
    # Everything in [b, chunk, head, l, ...] layout, so the big [b,c,h,l,s] tensors are made contiguous once.
    xd = xd.reshape(b, c, Q, h, p).permute(0, 1, 3, 2, 4)  # [b,c,h,l,p]
    a = a.reshape(b, c, Q, h).permute(0, 1, 3, 2)  # [b,c,h,l]
    B = B.reshape(b, c, Q, n)  # [b,c,l,n]
    C = C.reshape(b, c, Q, n)
    a_cum = torch.cumsum(a, dim=-1)  # [b,c,h,l]

    # 1. Inside each chunk: y_l = Σ_{s<=l} (C_l·B_s) exp(a_{s+1..l}) xd_s, a masked (Q×Q) product per head.
    CB = torch.matmul(C, B.transpose(-1, -2))  # [b,c,l,s]
    y = torch.matmul(CB.unsqueeze(2) * torch.exp(segsum(a)), xd)  # [b,c,h,l,p]

    # 2. Each chunk's end state from its own inputs: Σ_s exp(a_{s+1..Q}) xd_s ⊗ B_s.
    decay_states = torch.exp(a_cum[..., -1:] - a_cum)  # [b,c,h,l]
    chunk_states = torch.matmul((xd * decay_states.unsqueeze(-1)).transpose(-1, -2), B.unsqueeze(2))  # [b,c,h,p,n]

    # 3. Pass the state between chunks: s_z = exp(Σ a over chunk z) s_{z−1} + chunk_states_z. ssd_minimal_discrete
    #    writes this as a (c+1)² segment-sum matrix; like mamba_ssm's state-passing kernel we run it as the short
    #    recurrence it is (c = T/Q steps), which is exact and cheaper.
    chunk_decay = torch.exp(a_cum[..., -1])[..., None, None]  # [b,c,h,1,1]
    state = initial_state
    entering = []
    for z in range(c):
        entering.append(state)
        state = chunk_states[:, z] if state is None else torch.addcmul(chunk_states[:, z], state, chunk_decay[:, z])
    final_state = state

    # 4. The state carried into each chunk: y_l += exp(a_{1..l}) C_l · s_in (nothing when it is zero).
    if entering[-1] is not None:
        if entering[0] is None:
            entering[0] = torch.zeros_like(chunk_states[:, 0])
        s_in = torch.stack(entering, dim=1)  # [b,c,h,p,n]
        y = y + torch.matmul(C.unsqueeze(2), s_in.transpose(-1, -2)) * torch.exp(a_cum).unsqueeze(-1)

    y = y.permute(0, 1, 3, 2, 4).reshape(b, c * Q, h, p)[:, :T]
    return y, final_state


def ssm_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The same function as `ssd_chunked`, as the literal sequential recurrence (slow; for checking)."""
    b, T, h, p = x.shape
    n = B.shape[-1]
    s = initial_state if initial_state is not None else x.new_zeros(b, h, p, n)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        s = decay * s + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", s, C[:, t]))
    return torch.stack(ys, dim=1), s


# ---------------------------------------------------------------------------------------------
# State of the streaming path (MODEL.md §3)


@dataclass
class State:
    """Per-stream carried state, batched over S streams.

    conv[l]: [S, W-1, E+2N], the last W-1 raw xBC inputs of layer l, oldest first;
    ssm[l]: [S, Hh, P, N]; cfc: [S, C].
    """
    conv: List[Tensor]
    ssm: List[Tensor]
    cfc: Tensor

    @staticmethod
    def zeros(cfg: ModelConfig, streams: int, dtype=torch.float32, device=None) -> "State":
        W, cd = cfg.d_conv, cfg.conv_dim
        return State(
            conv=[torch.zeros(streams, W - 1, cd, dtype=dtype, device=device) for _ in range(cfg.n_layers)],
            ssm=[torch.zeros(streams, cfg.n_heads, cfg.headdim, cfg.d_state, dtype=dtype, device=device)
                 for _ in range(cfg.n_layers)],
            cfc=torch.zeros(streams, cfg.cfc_units, dtype=dtype, device=device))

    def detach(self) -> "State":
        return State([t.detach() for t in self.conv], [t.detach() for t in self.ssm], self.cfc.detach())

    def copy_(self, other: "State") -> "State":
        """In-place copy (keeps the storage: what a captured CUDA graph needs)."""
        for a, b in zip(self.conv, other.conv):
            a.copy_(b)
        for a, b in zip(self.ssm, other.ssm):
            a.copy_(b)
        self.cfc.copy_(other.cfc)
        return self

    def clone(self) -> "State":
        return State([t.clone() for t in self.conv], [t.clone() for t in self.ssm], self.cfc.clone())


# ---------------------------------------------------------------------------------------------
# Modules; attribute names are the checkpoint keys of MODEL.md §4


class Normalizer(nn.Module):
    """x = (u − mean) ⊙ inv_std; buffers `norm.mean`, `norm.inv_std` (fitted, not trained)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("inv_std", torch.ones(n))

    def forward(self, u: Tensor) -> Tensor:
        return (u - self.mean) * self.inv_std


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer with ngroups=1, rmsnorm=True, norm_before_gate=False, no projection biases."""

    def __init__(self, cfg: ModelConfig, chunk: int = 64):
        super().__init__()
        self.cfg = cfg
        self.chunk = chunk
        D, E, N, Hh, W, cd = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.n_heads, cfg.d_conv, cfg.conv_dim
        self.in_proj = nn.Linear(D, cfg.in_proj_dim, bias=False)
        self.conv1d = nn.Conv1d(cd, cd, W, groups=cd, bias=True)  # weight [cd, 1, W]
        self.dt_bias = nn.Parameter(torch.zeros(Hh))
        self.A_log = nn.Parameter(torch.zeros(Hh))
        self.D = nn.Parameter(torch.ones(Hh))
        self.norm = nn.RMSNorm(E, eps=RMS_EPS)
        self.out_proj = nn.Linear(E, D, bias=False)

    def _split(self, zxbcdt: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        E, cd = self.cfg.d_inner, self.cfg.conv_dim
        return zxbcdt[..., :E], zxbcdt[..., E:E + cd], zxbcdt[..., E + cd:]

    def forward(self, r: Tensor, conv_state: Optional[Tensor] = None, ssm_state: Optional[Tensor] = None,
                scan: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """r [b,T,D] (already pre-normed) → (out [b,T,D], final conv state, final ssm state)."""
        cfg = self.cfg
        b, T, _ = r.shape
        E, N, P, Hh, W = cfg.d_inner, cfg.d_state, cfg.headdim, cfg.n_heads, cfg.d_conv
        z, xBC, dt_raw = self._split(self.in_proj(r))
        # Causal depthwise conv over [carried W-1 raw inputs ; window].
        if conv_state is None:
            hist = F.pad(xBC, (0, 0, W - 1, 0))  # [b, W-1+T, cd], zeros before the window
        else:
            hist = torch.cat([conv_state, xBC], dim=1)
        new_conv_state = hist[:, T:]  # the last W-1 raw inputs
        xBC = F.silu(F.conv1d(hist.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                              groups=cfg.conv_dim).transpose(1, 2))  # [b,T,cd]
        xs = xBC[..., :E].reshape(b, T, Hh, P)
        Bm, Cm = xBC[..., E:E + N], xBC[..., E + N:]
        dt = F.softplus(dt_raw + self.dt_bias)  # threshold 20: x itself above, as MODEL.md says
        A = -torch.exp(self.A_log)
        if scan:
            y, new_ssm_state = ssm_scan(xs, dt, A, Bm, Cm, ssm_state)
        else:
            y, new_ssm_state = ssd_chunked(xs, dt, A, Bm, Cm, self.chunk, ssm_state)
        y = y + self.D[:, None] * xs
        yn = self.norm(y.reshape(b, T, E) * F.silu(z))
        return self.out_proj(yn), new_conv_state, new_ssm_state

    def step(self, r: Tensor, conv_state: Tensor, ssm_state: Tensor,
             inplace: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """One event per stream: r [S,D] → (out [S,D], new conv state, new ssm state).

        With `inplace`, the given (contiguous) state tensors are updated and returned: no allocation, and the
        [S,Hh,P,N] state, the bulk of the memory traffic with many streams, is read and written twice."""
        cfg = self.cfg
        S = r.shape[0]
        E, N, P, Hh = cfg.d_inner, cfg.d_state, cfg.headdim, cfg.n_heads
        z, xBC, dt_raw = self._split(self.in_proj(r))
        win = torch.cat([conv_state, xBC.unsqueeze(1)], dim=1)  # [S, W, cd], oldest first
        xBC = F.silu(torch.einsum("swc,cw->sc", win, self.conv1d.weight[:, 0, :]) + self.conv1d.bias)
        xs = xBC[:, :E].reshape(S, Hh, P)
        Bm, Cm = xBC[:, E:E + N], xBC[:, E + N:]
        dt = F.softplus(dt_raw + self.dt_bias)  # [S,Hh]
        decay = torch.exp(dt * -torch.exp(self.A_log))[:, :, None, None]
        dtx = (dt[:, :, None] * xs)[..., None]  # [S,Hh,P,1]
        if inplace:
            s = ssm_state.mul_(decay).addcmul_(dtx, Bm[:, None, None, :])
            conv_state.copy_(win[:, 1:])
            new_conv = conv_state
        else:
            s = torch.addcmul(ssm_state * decay, dtx, Bm[:, None, None, :])
            new_conv = win[:, 1:]
        y = torch.matmul(s.reshape(S, Hh * P, N), Cm.unsqueeze(-1)).reshape(S, Hh, P) + self.D[:, None] * xs
        yn = self.norm(y.reshape(S, E) * F.silu(z))
        return self.out_proj(yn), new_conv, s


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, chunk: int = 64):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.d_model, eps=RMS_EPS)
        self.mixer = Mamba2Mixer(cfg, chunk)


class CfC(nn.Module):
    """Closed-form continuous-time cell, "default" mode (Hasani et al. 2022), MODEL.md §2.4."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, C, K = cfg.d_model, cfg.cfc_units, cfg.cfc_backbone
        self.d_model = D
        self.backbone = nn.Linear(D + C, K)
        self.ff1 = nn.Linear(K, C)
        self.ff2 = nn.Linear(K, C)
        self.time_a = nn.Linear(K, C)
        self.time_b = nn.Linear(K, C)

    # The recurrence is launch-bound (tiny matrices, T steps, twice for backward), so each step is few kernels:
    # lecun_tanh(v) = 1.7159·tanh(0.666·v) has its 0.666 folded into the backbone's affine map and its 1.7159
    # into the four heads' (one [4C, K] matrix), so a step is addmm → tanh → addmm → tanh(f1, f2 together)
    # → addcmul + sigmoid (τ) → lerp (f1·(1 − τ) + τ·f2 = lerp(f1, f2, τ)). Same function, autograd throughout.
    def _heads_t(self) -> Tuple[Tensor, Tensor]:
        w = torch.cat([self.ff1.weight, self.ff2.weight, self.time_a.weight, self.time_b.weight], dim=0)
        bias = torch.cat([self.ff1.bias, self.ff2.bias, self.time_a.bias, self.time_b.bias], dim=0)
        return (w * LECUN_SCALE).t(), bias

    @staticmethod
    def _cell(pre: Tensor, dt: Tensor, w4_t: Tensor, b4: Tensor) -> Tensor:
        """pre = 0.666·(backbone pre-activation) [b,K]; returns c_t [b,C]."""
        C = b4.shape[0] // 4
        # split/chunk, not slicing: their backward is one cat, where each slice's backward fills a zero tensor.
        p12, ta, tb = torch.addmm(b4, torch.tanh(pre), w4_t).split([2 * C, C, C], dim=-1)
        f1, f2 = torch.tanh(p12).chunk(2, dim=-1)
        tau = torch.sigmoid(torch.addcmul(tb, ta, dt.unsqueeze(-1)))
        return torch.lerp(f1, f2, tau)

    def forward(self, s: Tensor, dt: Tensor, c: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """s [b,T,D], dt [b,T] → (c_t for every t [b,T,C], final c [b,C])."""
        D = self.d_model
        b, T, _ = s.shape
        w = self.backbone.weight * LECUN_SLOPE
        pre_s = F.linear(s.transpose(0, 1), w[:, :D], self.backbone.bias * LECUN_SLOPE)  # [T,b,K], hoisted
        w_c_t = w[:, D:].t()
        w4_t, b4 = self._heads_t()
        if c is None:
            c = s.new_zeros(b, w_c_t.shape[0])
        out = []
        for pre_t, dt_t in zip(pre_s.unbind(0), dt.unbind(1)):  # unbind: one stack in backward, not T zero-fills
            c = self._cell(torch.addmm(pre_t, c, w_c_t), dt_t, w4_t, b4)
            out.append(c)
        return torch.stack(out, dim=1), c

    def step(self, s: Tensor, dt: Tensor, c: Tensor) -> Tensor:
        w4_t, b4 = self._heads_t()
        pre = F.linear(torch.cat([s, c], dim=-1), self.backbone.weight * LECUN_SLOPE, self.backbone.bias * LECUN_SLOPE)
        return self._cell(pre, dt, w4_t, b4)


class GRN(nn.Module):
    """Gated residual network (Lim et al. 2021), MODEL.md §2.5."""

    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.fc2 = nn.Linear(d_in, hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.skip = nn.Linear(d_in, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden, eps=LN_EPS)

    def forward(self, a: Tensor) -> Tensor:
        e1 = self.fc1(F.elu(self.fc2(a)))
        glu = torch.sigmoid(self.gate(e1)) * self.value(e1)
        return self.norm(self.skip(a) + glu)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.grn = GRN(cfg.head_input, cfg.grn_hidden)
        self.out = nn.Linear(cfg.grn_hidden, cfg.n_horizons)

    def forward(self, a: Tensor) -> Tensor:
        return self.out(self.grn(a))


class PerceptionNet(nn.Module):
    """PerceptionNet v1 (MODEL.md §2). `chunk` is the SSD chunk length (a speed knob, not part of the math)."""

    def __init__(self, cfg: ModelConfig, chunk: int = 64):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.norm = Normalizer(cfg.n_features)
        self.embed = nn.Linear(cfg.n_features, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg, chunk) for _ in range(cfg.n_layers)])
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=RMS_EPS)
        self.cfc = CfC(cfg)
        self.head = Head(cfg)

    def set_chunk(self, chunk: int) -> None:
        for layer in self.layers:
            layer.mixer.chunk = chunk

    def forward(self, u: Tensor, dt: Tensor, state: Optional[State] = None, scan: bool = False,
                return_state: bool = False):
        """Sequence path: u [b,T,F], dt [b,T] → logits [b,T,H] (and the final State if asked).

        `state` (optional) is the carried initial state; `scan=True` uses the sequential SSM scan.
        """
        h = self.embed(self.norm(u))
        conv_out, ssm_out = [], []
        for l, layer in enumerate(self.layers):
            out, cs, ss = layer.mixer(layer.norm(h),
                                      None if state is None else state.conv[l],
                                      None if state is None else state.ssm[l], scan=scan)
            h = h + out
            conv_out.append(cs)
            ssm_out.append(ss)
        s = self.norm_f(h)
        c_all, c_last = self.cfc(s, dt, None if state is None else state.cfc)
        logits = self.head(torch.cat([s, c_all], dim=-1))
        if return_state:
            return logits, State(conv_out, ssm_out, c_last)
        return logits

    def step(self, u: Tensor, dt: Tensor, state: State, inplace: bool = False) -> Tuple[Tensor, State]:
        """Step path: one event per stream, u [S,F], dt [S] → (logits [S,H], new State).

        `inplace` updates `state`'s tensors and returns it (what a served stream or a CUDA graph wants)."""
        h = self.embed(self.norm(u))
        conv_out, ssm_out = [], []
        for l, layer in enumerate(self.layers):
            out, cs, ss = layer.mixer.step(layer.norm(h), state.conv[l], state.ssm[l], inplace=inplace)
            h = h + out
            conv_out.append(cs)
            ssm_out.append(ss)
        s = self.norm_f(h)
        c = self.cfc.step(s, dt, state.cfc)
        logits = self.head(torch.cat([s, c], dim=-1))
        if inplace:
            state.cfc.copy_(c)
            return logits, state
        return logits, State(conv_out, ssm_out, c)

    @torch.no_grad()
    def init_parameters(self, seed: int = 0) -> None:
        """MODEL.md §4 initialization (the distributions; the engine's exact numbers are not reproduced)."""
        g = torch.Generator().manual_seed(seed)
        cfg = self.cfg

        def uni(t: Tensor, bound: float) -> None:
            t.copy_((torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound)

        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name in ("norm_f.weight",) or name.endswith("mixer.D"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            elif name.endswith("dt_bias"):
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(torch.rand(p.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g, dtype=torch.float64) * 15 + 1))
            elif "conv1d" in name:
                uni(p, 1 / math.sqrt(cfg.d_conv))
            elif name.endswith("out_proj.weight"):
                uni(p, 1 / math.sqrt(cfg.d_inner) / math.sqrt(cfg.n_layers))
            else:  # every Linear: U(±1/√fan_in) for weight and bias
                fan_in = self._fan_in(name)
                uni(p, 1 / math.sqrt(fan_in))
        self.norm.mean.zero_()
        self.norm.inv_std.fill_(1.0)

    def _fan_in(self, name: str) -> int:
        module = self.get_submodule(name.rsplit(".", 1)[0])
        return module.weight.shape[1]


# ---------------------------------------------------------------------------------------------
# Loss and conviction (MODEL.md §2.7, §2.8)


def masked_bce(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Σ m ⊙ bce(logits, y) / max(Σ m, 1). binary_cross_entropy_with_logits is the same stable
    formula as MODEL.md's max(l,0) − l·y + log(1 + exp(−|l|)), with the exact gradient σ(l) − y."""
    per = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    return (per * mask).sum() / mask.sum().clamp_min(1.0)


def strongest_horizon(logits: Tensor) -> Tensor:
    """The horizon whose probability lies farthest from 0.5 (the first maximum on ties), keeping the last dim.

    |sigmoid(l) - 0.5| grows with |l|, so the logits decide: rounded probabilities would split exact ties and tie
    every float32 logit past ~17 at 0.5."""
    return torch.argmax(logits.abs(), dim=-1, keepdim=True)


def conviction(logits: Tensor) -> Tensor:
    p = torch.sigmoid(logits)
    return 2 * p.gather(-1, strongest_horizon(logits)).squeeze(-1) - 1


# ---------------------------------------------------------------------------------------------
# Optimizer (MODEL.md §5)


def decays(name: str, p: Tensor) -> bool:
    """MODEL.md §4 weight-decay column: exactly the 2-D Linear weights."""
    return name.endswith(".weight") and p.dim() == 2


def param_groups(model: nn.Module, weight_decay: float = 0.01) -> List[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.01, **kwargs) -> torch.optim.AdamW:
    """torch.optim.AdamW with MODEL.md §5's hyperparameters and §4's decay groups."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.999), eps=1e-8, **kwargs)


def clip_and_step(model: nn.Module, opt: torch.optim.Optimizer, max_norm: float = 1.0) -> Tensor:
    """Global-norm clipping (scale = min(1, max/(‖g‖+1e-6)), torch's exact rule; max_norm <= 0 clips nothing) then
    the AdamW step, which a norm that is not finite skips, as clip_grad_norm_(error_if_nonfinite=True) refuses it
    (README.md's decisions: the engine takes no step there). Returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf).detach()
    if torch.isfinite(norm):
        opt.step()
    return norm


# ---------------------------------------------------------------------------------------------
# Checkpoints (MODEL.md §6)


def read_checkpoint(path: str) -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    return load_file(path), metadata


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, device="cpu", chunk: int = 64,
                    optimizer_kwargs: Optional[dict] = None, lr: float = 1e-3, weight_decay: float = 0.01):
    """Loads a PerceptionNet v1 checkpoint exactly as a PyTorch user would.

    Returns (model, optimizer, step): the model built from the metadata config with every parameter
    and buffer loaded via `load_state_dict(tensors, strict=False)` (only the optim.* keys are
    unexpected; a missing model key is an error), and a `torch.optim.AdamW` (MODEL.md §4/§5 groups)
    holding the checkpoint's moments and step, so training continues where it stopped.
    """
    tensors, metadata = read_checkpoint(path)
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: metadata format is {metadata.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    cfg = ModelConfig.from_json(metadata["config"])
    model = PerceptionNet(cfg, chunk=chunk)
    result = model.load_state_dict(tensors, strict=False)
    if result.missing_keys:
        raise ValueError(f"{path}: missing tensors {result.missing_keys}")
    bad = [k for k in result.unexpected_keys if not k.startswith("optim.")]
    if bad:
        raise ValueError(f"{path}: unknown tensors {bad}")
    model.to(device=device, dtype=dtype)
    step = int(metadata["step"]) if "step" in metadata else int(tensors["optim.step"].item())
    opt = make_optimizer(model, lr=lr, weight_decay=weight_decay, **(optimizer_kwargs or {}))
    restore_optimizer(opt, model, tensors, step)
    return model, opt, step


def restore_optimizer(opt: torch.optim.AdamW, model: nn.Module, tensors: Dict[str, Tensor], step: int) -> None:
    """Puts `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>` and the step into AdamW's state through
    `load_state_dict`, so torch itself places them (device, dtype; `step` on the device when capturable)."""
    if step == 0:
        return  # a fresh optimizer: AdamW initializes its state lazily on the first step
    sd = opt.state_dict()
    names = dict((id(p), n) for n, p in model.named_parameters())
    index = 0
    state = {}
    for group in opt.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            state[index] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": tensors[f"optim.exp_avg.{n}"].to(dtype=p.dtype, device=p.device),
                "exp_avg_sq": tensors[f"optim.exp_avg_sq.{n}"].to(dtype=p.dtype, device=p.device),
            }
            index += 1
    sd["state"] = state
    opt.load_state_dict(sd)


def save_checkpoint(path: str, model: PerceptionNet, opt: Optional[torch.optim.AdamW], step: int) -> None:
    """Writes MODEL.md §6's layout (F32, moments, step, metadata) from a PyTorch model and optimizer."""
    from safetensors.torch import save_file
    out = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    for n, p in model.named_parameters():
        st = opt.state.get(p, {}) if opt is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            v = st.get(key)
            out[f"optim.{key}.{n}"] = (v.detach().to("cpu", torch.float32) if v is not None
                                       else torch.zeros(p.shape, dtype=torch.float32)).contiguous()
    out["optim.step"] = torch.tensor([float(step)], dtype=torch.float32)
    cfg = dict(dataclasses.asdict(model.cfg))
    save_file(out, path, metadata={"format": CHECKPOINT_FORMAT, "config": json.dumps(cfg), "step": str(step)})
