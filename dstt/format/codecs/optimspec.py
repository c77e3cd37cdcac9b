"""Which predictor codes each tensor of a parameter's state, and with which
constants: the encoder's side of predictive chunks (no torch).

The decoder never computes a constant: it reads them from the chunk's
:class:`~dstt.format.codecs.predictors.Coding`. So how they are computed here only
decides how often the prediction is exact (bytes), never whether a chunk
decodes right. They are computed the way torch 2.13 computes them on CPU
for each optimizer variant (read from ``torch/optim/adam.py``, ``sgd.py``
and ``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``): in Python floats
(double) for the plain, foreach and fused paths, in float32 where torch
holds them in 0-d float32 tensors (a tensor ``lr``, capturable), cast to the
tensor's dtype where torch's kernel casts the scalar (``add`` of ``eps`` and
``alpha=`` on bfloat16 / float16 tensors).

:func:`adam_codings` and :func:`sgd_codings` take plain numbers: the
optimizer's ``param_groups`` entry (``lr`` may be a numpy 0-d array when it
was a 0-d tensor: its dtype is what torch computed in) and the per-parameter
``state["step"]`` of the two steps. They return a coding per state key;
``None`` means "store whole" (there is nothing at t-1 to predict from).

>>> h = AdamHyper.from_group({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
...                           "amsgrad": False, "decoupled_weight_decay": True})
>>> cs = adam_codings(h, 5.0, 4.0, param_dtype="float32", state_dtype="float32")
>>> sorted((r, c.predictor) for r, c in cs.items())
[('exp_avg', 'delta'), ('exp_avg_sq', 'adam'), ('param', 'adam')]
>>> adam_codings(h, 5.0, 5.0, param_dtype="float32", state_dtype="float32")["param"].predictor  # no grad: skipped
'delta'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dstt.errors import ConfigError
from dstt.format.codecs.predictors import FLOAT_DTYPES, Coding, as_f32_const

ADAM_VARIANTS = ("single", "foreach", "fused", "capturable", "foreach_capturable")
SGD_VARIANTS = ("single", "foreach", "fused")


def delta(role: str, dtype: str) -> Coding:
    """The chained delta coding of a tensor: predicted = itself at t-1."""
    return Coding("delta", 1, role, dtype)


def _scalar(x: Any) -> tuple[float, str | None]:
    """A hyperparameter as (value, dtype of the 0-d tensor it was, or None)."""
    if isinstance(x, (np.ndarray, np.generic)):
        if x.size != 1 or x.dtype.kind != "f":
            raise ConfigError(f"hyperparameter {x!r} is not a float scalar")
        return float(x.reshape(())), x.dtype.name
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ConfigError(f"hyperparameter {x!r} is not a number")
    return float(x), None


def _variant(group: Mapping[str, Any], device: str) -> str:
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:  # torch picks foreach by default on CUDA only
        foreach = device == "cuda"
    if group.get("capturable"):
        return "foreach_capturable" if foreach else "capturable"
    return "foreach" if foreach else "single"


@dataclass(frozen=True)
class AdamHyper:
    """Adam / AdamW hyperparameters of one param group, as torch uses them."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False  # AdamW, or Adam(decoupled_weight_decay=True)
    amsgrad: bool = False
    maximize: bool = False  # no effect on the prediction: the sign is in exp_avg already
    variant: str = "single"
    lr_dtype: str | None = None  # lr was a 0-d tensor of this dtype
    beta_dtype: str | None = None  # betas were 0-d tensors of this dtype
    differentiable: bool = False

    def __post_init__(self) -> None:
        if self.variant not in ADAM_VARIANTS:
            raise ConfigError(f"adam variant must be one of {ADAM_VARIANTS}, got {self.variant!r}")

    @classmethod
    def from_group(cls, group: Mapping[str, Any], *, decoupled: bool = False, device: str = "cpu") -> AdamHyper:
        """From a ``param_groups`` entry (``decoupled``: the default of
        ``decoupled_weight_decay`` when the group has no such key, True for
        AdamW of torch versions before it had one)."""
        lr, lr_dtype = _scalar(group["lr"])
        (b1, bd1), (b2, _) = (_scalar(b) for b in group.get("betas", (0.9, 0.999)))
        wd, _ = _scalar(group.get("weight_decay", 0.0))
        eps, _ = _scalar(group.get("eps", 1e-8))
        return cls(lr, b1, b2, eps, wd, bool(group.get("decoupled_weight_decay", decoupled)),
                   bool(group.get("amsgrad", False)), bool(group.get("maximize", False)),
                   _variant(group, device), lr_dtype, bd1, bool(group.get("differentiable", False)))


def _pow32(x: np.floating[Any], e: float) -> np.floating[Any]:
    """``tensor ** e`` on a float32 0-d tensor as torch's CPU kernel computes
    it: exponents 2, 3, 0.5, -0.5, -1, -2 are multiplications, square roots
    and reciprocals; anything else is ``powf``."""
    t = type(x)
    special = {2.0: lambda: x * x, 3.0: lambda: x * x * x, 0.5: lambda: np.sqrt(x),
               -0.5: lambda: t(1) / np.sqrt(x), -1.0: lambda: t(1) / x, -2.0: lambda: t(1) / (x * x)}
    with np.errstate(all="ignore"):
        out: np.floating[Any] = special[e]() if e in special else x ** t(e)
    return out


def _adam_param_consts(h: AdamHyper, step: float, eps: float) -> dict[str, float]:
    """S, B, E (and WD, D) as torch computes them for this variant."""
    c: dict[str, float] = {}
    if h.weight_decay != 0 and h.decoupled:
        if h.lr_dtype is not None and h.variant in ("single", "foreach"):
            t = np.dtype(h.lr_dtype).type
            c["WD"] = float(t(1) - t(h.lr) * t(h.weight_decay))  # 0-d tensor arithmetic
        else:
            c["WD"] = 1 - h.lr * h.weight_decay
    if h.variant in ("capturable", "foreach_capturable"):  # step, betas, lr in 0-d float32 tensors
        f = np.float32
        with np.errstate(all="ignore"):
            bc1 = f(h.beta1) ** f(step) - f(1)  # beta1**step - 1 = -(1 - beta1**step)
            bc2s = np.sqrt(f(1) - f(h.beta2) ** f(step))
            if h.variant == "capturable":  # denom = sqrt(v) / (bc2s * -ss) + eps / -ss; p + m / denom
                ns = -((f(1) / -bc1) * f(h.lr))  # float / tensor is reciprocal(tensor) * float
                c.update(S=1.0, B=float(bc2s * ns), E=float((f(1) / ns) * f(eps)))
            else:  # denom = (sqrt(v) / bc2s + eps) / ss with ss = 1 / ((beta1**step - 1) / lr)
                c.update(S=1.0, B=float(bc2s), E=eps, D=float(f(1) / (bc1 / f(h.lr))))
        return c
    bc1, bc2 = 1 - h.beta1 ** step, 1 - h.beta2 ** step
    if h.beta_dtype is not None and h.variant in ("single", "foreach"):  # betas in 0-d tensors
        t = np.dtype(h.beta_dtype).type
        with np.errstate(all="ignore"):
            tb1 = t(1) - _pow32(t(h.beta1), step)
            ss = t(h.lr) / tb1 if h.lr_dtype else (t(1) / tb1) * t(h.lr)  # float / tensor: reciprocal * float
            c.update(S=float(-ss), B=float(_pow32(t(1) - _pow32(t(h.beta2), step), 0.5)), E=eps)
    elif h.variant == "fused":  # double math in the kernel
        c.update(S=-(h.lr / bc1), B=math.sqrt(bc2), E=eps)
    elif h.lr_dtype is not None:  # step_size = lr / bias_correction1 in the tensor's dtype
        t = np.dtype(h.lr_dtype).type
        c.update(S=float(-(t(h.lr) / t(bc1))), B=bc2 ** 0.5, E=eps)
    else:
        c.update(S=-(h.lr / bc1), B=bc2 ** 0.5, E=eps)
    return c


def _round_dtype(x: float, dtype: str) -> float:
    """``x`` as torch casts a Python scalar to a tensor's dtype (via float32)."""
    from dstt.format.codecs.predictors import Scratch, round_to

    a = np.array([x], np.float32)
    round_to(a, dtype, Scratch(1))
    return float(a[0])


def _consts(raw: dict[str, float]) -> dict[str, float] | None:
    try:
        return {k: as_f32_const(v) for k, v in raw.items()}
    except ConfigError:  # a constant overflows float32 (lr 0 under capturable, ...): no prediction
        return None


def adam_codings(h: AdamHyper, step: float, prev_step: float | None, *, param_dtype: str, state_dtype: str,
                 grad_dtype: str | None = None) -> dict[str, Coding | None]:
    """The coding of each tensor of one Adam parameter at ``step``
    (``state["step"]`` after this optimizer step), given the parameter's
    ``state["step"]`` at the previous captured step (None: it had no state
    yet, torch's zeros are the previous state). Keys: ``param``,
    ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad).

    Chained deltas where the prediction cannot hold: no gradient this step
    (``step == prev_step``: torch skipped the parameter), more than one
    optimizer step since the previous capture, ``differentiable``, dtypes
    other than float32 / bfloat16 / float16. ``grad_dtype``: the gradient's
    dtype (default: the parameter's; float32 when the state is float32 and
    the parameter is not, the master-weights setup).
    """
    roles = ["param", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h.amsgrad else [])
    plain: dict[str, Coding | None] = {r: delta(r, param_dtype if r == "param" else state_dtype) for r in roles}
    fresh = prev_step is None
    if fresh:
        plain.update({r: None for r in roles if r != "param"})
    if (h.differentiable or param_dtype not in FLOAT_DTYPES or state_dtype not in FLOAT_DTYPES
            or step != (1 if fresh else prev_step + 1)):  # type: ignore[operator]
        return plain
    mixed = param_dtype != state_dtype
    rnd = "end" if h.variant == "fused" or mixed else "op"
    grad = grad_dtype or (state_dtype if mixed else param_dtype)
    eps = h.eps if rnd == "end" else _round_dtype(h.eps, state_dtype)  # add_(eps) casts eps to the dtype
    pc = _consts(_adam_param_consts(h, step, eps))
    if h.beta_dtype is not None and h.variant in ("single", "foreach"):
        t = np.dtype(h.beta_dtype).type
        vc = _consts({"W": float(t(1) - t(h.beta1)), "B2": h.beta2, "C2": float(t(1) - t(h.beta2))})
    else:
        vc = _consts({"W": 1 - h.beta1, "B2": h.beta2, "C2": 1 - h.beta2})
    out = dict(plain)
    if vc is not None and grad in FLOAT_DTYPES:
        out["exp_avg_sq"] = Coding("adam", 1, "exp_avg_sq", state_dtype,
                                   {"grad": grad, "round": rnd, "fresh": fresh, "c": vc})
    if h.amsgrad:
        out["max_exp_avg_sq"] = Coding("adam", 1, "max_exp_avg_sq", state_dtype, {"round": rnd, "fresh": fresh})
    if pc is not None:
        out["param"] = Coding("adam", 1, "param", param_dtype, {
            "state": state_dtype, "round": rnd, "denom": "max_exp_avg_sq" if h.amsgrad else "exp_avg_sq", "c": pc})
    return out


@dataclass(frozen=True)
class SgdHyper:
    """SGD hyperparameters of one param group, as torch uses them."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0  # no effect on the prediction: it is in the momentum buffer already
    nesterov: bool = False
    maximize: bool = False
    variant: str = "single"
    lr_dtype: str | None = None
    differentiable: bool = False

    @classmethod
    def from_group(cls, group: Mapping[str, Any], *, device: str = "cpu") -> SgdHyper:
        lr, lr_dtype = _scalar(group["lr"])
        return cls(lr, _scalar(group.get("momentum", 0.0))[0], _scalar(group.get("dampening", 0.0))[0],
                   _scalar(group.get("weight_decay", 0.0))[0], bool(group.get("nesterov", False)),
                   bool(group.get("maximize", False)), _variant(group, device), lr_dtype,
                   bool(group.get("differentiable", False)))


def sgd_codings(h: SgdHyper, has_prev_buffer: bool, *, param_dtype: str, state_dtype: str | None = None,
                grad_dtype: str | None = None) -> dict[str, Coding | None]:
    """The coding of ``param`` and ``momentum_buffer`` of one SGD parameter
    at a step (``has_prev_buffer``: the previous captured step had its
    momentum buffer). Without momentum there is no buffer and the parameter
    is a chained delta (its update is the gradient, not stored). The caller
    uses chained deltas when the parameter got no gradient this step."""
    state = state_dtype or param_dtype
    if h.momentum == 0:
        return {"param": delta("param", param_dtype)}
    out: dict[str, Coding | None] = {"param": delta("param", param_dtype),
                                     "momentum_buffer": delta("momentum_buffer", state) if has_prev_buffer else None}
    if h.differentiable or param_dtype not in FLOAT_DTYPES or state not in FLOAT_DTYPES \
            or (h.nesterov and not has_prev_buffer):
        return out
    mixed = param_dtype != state
    rnd = "end" if h.variant == "fused" or mixed else "op"

    def alpha(x: float, dtype: str) -> float:  # add_(t, alpha=x) casts alpha to a bf16/fp16 tensor's dtype
        return x if rnd == "end" else _round_dtype(x, dtype)

    lr = float(np.dtype(h.lr_dtype).type(h.lr)) if h.lr_dtype else h.lr
    raw = {"A": alpha(-lr, param_dtype)}
    params: dict[str, Any] = {"state": state, "round": rnd, "nesterov": h.nesterov}
    if h.nesterov:
        raw.update(MOM=h.momentum, DMP=alpha(1 - h.dampening, state), MN=alpha(h.momentum, state))
        params["grad"] = grad_dtype or (state if mixed else param_dtype)
    c = _consts(raw)
    if c is not None and params.get("grad", "float32") in FLOAT_DTYPES:
        out["param"] = Coding("sgd", 1, "param", param_dtype, {**params, "c": c})
    return out


@dataclass(frozen=True)
class ParamState:
    """One parameter at one captured step, as captured: its dtype, the
    dtype of each state tensor present (``exp_avg``, ``momentum_buffer``,
    ...; not ``step``) and ``state["step"]`` (None when absent)."""

    dtype: str
    state: Mapping[str, str]
    step: float | None = None


#: torch.optim classes with a predictor (others: chained deltas).
ADAM_CLASSES = {"Adam": False, "AdamW": True}  # name -> default of decoupled_weight_decay


def param_codings(optimizer: str, group: Mapping[str, Any], cur: ParamState, prev: ParamState | None, *,
                  device: str = "cpu") -> dict[str, Coding | None]:
    """The coding of a parameter (``"param"``) and each of its state tensors
    at a captured step, from the optimizer's class name, the parameter's
    ``param_groups`` entry at this step and what the previous captured step
    holds of it (None: nothing, every tensor is stored whole). A coding is
    only returned if everything it reads exists at the two steps with the
    dtypes it expects; else a chained delta, or None without a previous
    tensor."""
    roles = {"param": cur.dtype, **dict(cur.state)}
    if prev is None:
        return dict.fromkeys(roles)
    before = {"param": prev.dtype, **dict(prev.state)}
    wanted: dict[str, Coding | None] = {}
    if optimizer in ADAM_CLASSES and cur.step is not None and {"exp_avg", "exp_avg_sq"} <= set(cur.state):
        h = AdamHyper.from_group(group, decoupled=ADAM_CLASSES[optimizer], device=device)
        wanted = adam_codings(h, cur.step, prev.step if prev.state else None, param_dtype=cur.dtype,
                              state_dtype=cur.state["exp_avg"])
    elif optimizer == "SGD":
        h2 = SgdHyper.from_group(group, device=device)
        if "momentum_buffer" in cur.state:  # (a parameter SGD skipped is unchanged: the writer dedups it)
            wanted = sgd_codings(h2, "momentum_buffer" in prev.state, param_dtype=cur.dtype,
                                 state_dtype=cur.state["momentum_buffer"])
    out: dict[str, Coding | None] = {}
    for role, dtype in roles.items():
        plain = delta(role, dtype) if before.get(role) == dtype else None
        c = wanted.get(role, plain)
        ok = c is not None and c.dtype == dtype and all(
            (before if n.when == "prev" else roles).get(n.role) == n.dtype for n in c.needs())
        out[role] = c if ok else plain
    return out


__all__ = ["ADAM_CLASSES", "ADAM_VARIANTS", "ParamState", "param_codings", "AdamHyper", "SGD_VARIANTS", "SgdHyper", "adam_codings", "delta", "sgd_codings"]
