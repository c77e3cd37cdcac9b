"""Predictors for predictive chunks: the next step of optimizer state from
the previous one (numpy only, no torch).

An optimizer step is a deterministic function of the state before it and
the gradient; only the gradient is new. So given step t-1 of a parameter
(``param``, ``exp_avg``, ``exp_avg_sq``) and step t's ``exp_avg`` (stored
as a plain chained delta: it is fresh gradient noise), the rest of step t
is predicted and only ``zigzag(bits(actual) - bits(predicted))`` is stored
(dstt/format/codecs/predictive.py): most of it is zero. A misprediction costs bytes,
never correctness, because the decoder recomputes the same prediction with
the same code. docs/format.md "Predictive chunks" is the normative text;
this docstring is its summary.

Why the prediction is reproducible on any machine. Every operation below is
an elementwise numpy ufunc on float32 (or float64 for :func:`fma`) arrays:
``+ - * /``, ``sqrt``, comparisons and casts between float widths, each
correctly rounded to nearest-even as IEEE 754 requires and as numpy computes
them on every platform (one ufunc is one rounded operation: numpy never
contracts two into an FMA, and nothing here is a reduction, whose order
could vary). The order is fixed by this code and the constants are *recorded
with the chunk* (:class:`Coding`), never recomputed from hyperparameters by
the decoder (``beta ** step`` goes through the platform's ``pow``, which is
not correctly rounded everywhere). Two things could still differ between
machines, and both are removed: NaN payloads (x86 and ARM make different
default NaNs), so every NaN a prediction produces becomes one canonical NaN
(``0x7FC00000``; bfloat16 ``0x7FC0``, float16 ``0x7E00``); and
flush-to-zero / denormals-are-zero modes (``torch.set_flush_denormal``),
which :func:`check_ieee` detects, refusing to code or decode.

The predictors (name, version: recorded with every chunk; a reader refuses
one it does not know, :func:`predictor`):

* ``delta`` 1 -- chained delta: predicted = the same chunk at step t-1
  (any dtype of 1, 2, 4 or 8 bytes). For ``exp_avg``, ``momentum_buffer``,
  a parameter without a gradient this step, and everything else.
* ``adam`` 1 -- Adam / AdamW (torch.optim), roles ``exp_avg_sq``,
  ``max_exp_avg_sq`` (amsgrad) and ``param``, float32 / bfloat16 / float16.
* ``sgd`` 1 -- SGD with momentum, role ``param``.

The float predictors mirror torch's CPU kernels op by op (read from
torch 2.13's ``_single_tensor_adam``, ``_multi_tensor_adam``,
``FusedAdamKernel.cpp``, ``PointwiseOpsKernel.cpp`` and measured): ``F``
is the exact widening of a stored value to float32, ``R`` the rounding of a
float32 to the chunk's dtype (identity for float32), ``Rop`` is ``R`` when
the chunk was coded with ``round: "op"`` (torch's per-op kernels on
bfloat16/float16 state round every op's result) and the identity with
``round: "end"`` (fused kernels and float32 master state keep float32 until
the final store); ``fma(a, b, c)`` is float32(float64(a)*float64(b) +
float64(c)) -- torch's CPU kernels contract ``lerp``, ``addcmul`` and
``add(alpha=)`` into fused multiply-adds, which this reproduces except in
the rare cases where rounding twice differs from once (bytes, not
correctness)::

    adam exp_avg_sq:   g = Rg((m1 - m0) / W + m0)            # invert exp_avg.lerp_(g, W)
                       v = R(fma(C2 * g, g, Rop(v0 * B2)))    # mul_(beta2).addcmul_(g, g, 1-beta2)
    adam max_exp_avg_sq:  vmax0, or v1 where v1 > vmax0 or v1 is NaN
    adam param:        x = Rop(p0 * WD)                       # AdamW's decoupled decay, if any
                       d = Rop(Rop(Rop(sqrt(v1)) / B) + E)    # v1: exp_avg_sq or max_exp_avg_sq
                       d = Rop(d / D)                         # only if D is recorded (capturable)
                       p = R(x + (S * m1) / d)                # addcdiv_(m1, d, value=S)
    sgd param:         d = b1, or with nesterov:
                         g = Rg((b1 - Rop(b0 * MOM)) / DMP);  d = Rop(fma(b1, MN, g))
                       p = R(fma(d, A, p0))                   # add_(d, alpha=-lr)

Where torch itself rounds differently than any portable code can, the
prediction just misses: torch's CPU ``sqrt`` on float32 tensors (MKL/Sleef
vector code) is not correctly rounded (~20 % of results off by one ulp,
measured on AVX-512), so the single-tensor and foreach Adam paths predict
~99.7 % of parameters exactly while the fused kernel (``Vectorized::sqrt``,
correct) gives 100 %; ``exp_avg_sq`` depends on the gradient recovered from
``exp_avg``, which lost bits when it was rounded (80-95 % exact; with
float32 multiply-then-add instead of :func:`fma`, 5 points fewer).
The sqrt misses cost ~0.003 of a parameter's raw bytes per coded step
(0.011 vs 0.0075 for the fused kernel, tests/format/test_predict.py's tiny model);
benchmarks/bench_predict.py measures the fractions on a real trajectory.

>>> import numpy as np
>>> p0 = np.array([1.0, -0.5], np.float32)
>>> m1, v1 = np.array([0.1, 0.2], np.float32), np.array([0.01, 0.04], np.float32)
>>> c = Coding("adam", 1, "param", "float32", {"state": "float32", "round": "op",
...            "denom": "exp_avg_sq", "c": {"S": -0.001, "B": 1.0, "E": 1e-8}})
>>> out = np.empty(2, np.uint32)
>>> predictor("adam", 1).predict(c, {("prev", "param"): p0.view(np.uint32), ("cur", "exp_avg"): m1.view(np.uint32),
...                                  ("cur", "exp_avg_sq"): v1.view(np.uint32)}, out, Scratch(2))
>>> out.view(np.float32).tolist() == [float(np.float32(1.0) + np.float32(-0.001) * np.float32(0.1) / (np.sqrt(np.float32(0.01)) + np.float32(1e-8))),
...                                   float(np.float32(-0.5) + np.float32(-0.001) * np.float32(0.2) / (np.sqrt(np.float32(0.04)) + np.float32(1e-8)))]
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np

from dstt.errors import ConfigError, CorruptStoreError, FormatVersionError
from dstt.format.dtypes import info_for_name

#: Float dtypes the float predictors compute on (in float32).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
#: The canonical NaN of each float dtype (raw bits) every predicted NaN becomes.
CANONICAL_NAN = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}
#: Elements per block the predictors work on (float32: 256 KiB): small enough
#: that a block's inputs and scratch stay in a core's L2 cache, large enough
#: that numpy's per-call cost (and the GIL taken back between calls) stays
#: small: 65,536 coded ~1.3x the bytes per CPU second of 16,384 (issue 27).
#: The values do not depend on it (every operation is elementwise).
BLOCK = 65536
#: Roles (the optimizer state key a chunk holds, or ``param``).
ROLES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "other")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Need(NamedTuple):
    """One input a chunk's decode needs: the same flat slice of ``role``'s
    tensor at step ``when`` (``"prev"``: t-1, ``"cur"``: t), in ``dtype``."""

    when: str
    role: str
    dtype: str


@dataclass(frozen=True)
class Coding:
    """What a predictive chunk was coded with, recorded with it (the index).

    ``params`` holds the predictor's flags and its float32 constants
    (``params["c"]``, recorded as the JSON numbers of their exact values).
    """

    predictor: str
    version: int
    role: str
    dtype: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"predictor": self.predictor, "version": self.version, "role": self.role,
                "dtype": self.dtype, "params": dict(self.params)}

    def needs(self) -> list[Need]:
        """The inputs this chunk's decode reads (see :meth:`Predictor.needs`)."""
        got: list[Need] | None = self.__dict__.get("_needs")
        if got is None:
            got = predictor(self.predictor, self.version).needs(self)
            object.__setattr__(self, "_needs", got)  # a cache, not a field: equality ignores it
        return list(got)

    def consts(self) -> dict[str, np.float32]:
        """The recorded constants as float32 scalars."""
        got: dict[str, np.float32] | None = self.__dict__.get("_consts")
        if got is None:
            got = {k: np.float32(v) for k, v in self.params.get("c", {}).items()}
            object.__setattr__(self, "_consts", got)
        return got

    @classmethod
    def from_json(cls, doc: Any, where: str = "predictive chunk") -> Coding:
        """Parse and validate a recorded coding (untrusted: a store's index)."""
        if not isinstance(doc, dict) or set(doc) != {"predictor", "version", "role", "dtype", "params"}:
            raise CorruptStoreError(f"{where}: malformed coding {doc!r:.200}")
        name, version, role, dtype, params = (doc[k] for k in ("predictor", "version", "role", "dtype", "params"))
        if not isinstance(name, str) or type(version) is not int or not isinstance(role, str) \
                or not isinstance(dtype, str) or not isinstance(params, dict):
            raise CorruptStoreError(f"{where}: malformed coding {doc!r:.200}")
        c = cls(name, version, role, dtype, params)
        predictor(name, version).check(c, where)
        return c


class Scratch:
    """Reusable per-thread work buffers for blocks of up to ``n`` elements."""

    def __init__(self, n: int = BLOCK) -> None:
        self.n = n
        self.f = [np.empty(n, np.float32) for _ in range(4)]
        self.d = np.empty(n, np.float64)
        self.u = np.empty(n, np.uint32)
        self.mask = np.empty(n, np.bool_)
        self.zero = np.zeros(n, np.uint32)


# ----------------------------------------------------------------------------- float primitives


def f32_const(x: Any, where: str) -> np.float32:
    """A recorded constant: a finite JSON number that is exactly a float32."""
    try:
        ok = type(x) in (int, float) and bool(np.isfinite(x)) and float(np.float32(x)) == float(x)
    except (OverflowError, ValueError, TypeError):
        ok = False
    if not ok:
        raise CorruptStoreError(f"{where}: constant {x!r:.40} is not a finite float32")
    out: np.float32 = np.float32(x)
    return out


def as_f32_const(x: float) -> float:
    """``x`` rounded to float32, as the JSON number a :class:`Coding` records.

    >>> as_f32_const(0.1)
    0.10000000149011612
    """
    v = float(np.float32(x))
    if not np.isfinite(v):
        raise ConfigError(f"constant {x!r} is not a finite float32")
    return v


def load(raw: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """The values of raw bits ``raw`` (unsigned ints of the dtype's size) as
    float32, exactly; ``out`` is used unless ``raw`` already is float32."""
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "bfloat16":
        np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:  # float16
        np.copyto(out, raw.view(np.float16))
    return out


def store(x: np.ndarray, dtype: str, out: np.ndarray, s: Scratch) -> None:
    """Round float32 ``x`` to ``dtype`` (nearest-even) into raw bits ``out``;
    every NaN becomes the dtype's canonical NaN. ``x`` may be clobbered."""
    n = len(x)
    mask = s.mask[:n]
    np.isnan(x, out=mask)
    if dtype == "float32":
        np.copyto(out, x.view(np.uint32))
    elif dtype == "bfloat16":
        u = x.view(np.uint32)
        t = s.u[:n]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)  # wraps only for NaN bit patterns, replaced below
        np.right_shift(t, 16, out=t)
        np.copyto(out, t, casting="unsafe")
    else:
        np.copyto(out.view(np.float16), x, casting="same_kind")
    if mask.any():
        np.copyto(out, CANONICAL_NAN[dtype], where=mask, casting="unsafe")


def round_to(x: np.ndarray, dtype: str, s: Scratch) -> None:
    """Round float32 ``x`` in place to the nearest ``dtype`` value (kept as
    float32): ``F(R(x))``. Identity for float32."""
    if dtype == "float32":
        return
    n = len(x)
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        t = s.u[:n]
        mask = s.mask[:n]
        np.isnan(x, out=mask)
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(u, t, out=u)
        np.bitwise_and(u, 0xFFFF0000, out=u)
        np.copyto(u, 0x7FC00000, where=mask, casting="unsafe")
    else:
        h = s.u[:n].view(np.float16)[:n]
        np.copyto(h, x, casting="same_kind")
        np.copyto(x, h)


def fma(a: np.ndarray, b: Any, c: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    """``out = float32(float64(a) * float64(b) + float64(c))``: the product
    is exact in float64, so this is a fused multiply-add rounded twice."""
    t = s.d[: len(out)]
    np.multiply(a, b, out=t, dtype=np.float64)
    np.add(t, c, out=t)
    np.copyto(out, t, casting="same_kind")


# A subnormal doubled (0 under denormals-are-zero) and the smallest normal halved (0 under flush-to-zero).
_PROBE_IN = np.array([1e-45, 1.1754944e-38], np.float32)
_PROBE_BY = np.array([2.0, 0.5], np.float32)
_PROBE_IEEE = np.array([2.8e-45, 5.877472e-39], np.float32).tobytes()


def check_ieee() -> None:
    """Refuse to predict in a thread that flushes subnormals to zero (FTZ /
    DAZ, e.g. after ``torch.set_flush_denormal(True)``): its float results
    differ from everyone else's, so a decode would be silently wrong."""
    if np.multiply(_PROBE_IN, _PROBE_BY).tobytes() != _PROBE_IEEE:
        raise ConfigError("predictive chunks need IEEE subnormal arithmetic, but this thread flushes "
                          "denormals to zero (torch.set_flush_denormal(True)?): code or read them in "
                          "a thread without it")


# ----------------------------------------------------------------------------- predictors


def _flag(c: Coding, key: str, allowed: tuple[Any, ...], where: str) -> Any:
    v = c.params.get(key)
    if v not in allowed or type(v) is not type(allowed[0]):
        raise CorruptStoreError(f"{where}: {c.predictor} coding has {key}={v!r}, expected one of {allowed}")
    return v


def _consts(c: Coding, required: tuple[str, ...], optional: tuple[str, ...], where: str) -> dict[str, np.float32]:
    raw = c.params.get("c")
    if not isinstance(raw, dict) or not set(required) <= set(raw) <= set(required) | set(optional):
        raise CorruptStoreError(f"{where}: {c.predictor} {c.role} constants {raw!r:.200} "
                                f"(need {', '.join(required)})")
    return {k: f32_const(v, f"{where}: {k}") for k, v in raw.items()}


class Predictor:
    """A predictor: what a chunk of each role needs and how it is predicted."""

    name = ""
    version = 0
    roles: tuple[str, ...] = ()

    def check(self, c: Coding, where: str) -> None:
        """Validate ``c``'s role, dtype and parameters (raises CorruptStoreError)."""
        if c.role not in self.roles:
            raise CorruptStoreError(f"{where}: predictor {self.name} has no role {c.role!r}")

    def needs(self, c: Coding) -> list[Need]:
        """The inputs a chunk's prediction reads, in decode order."""
        raise NotImplementedError

    def predict(self, c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        """Write the predicted raw bits of one block to ``out``; ``ins`` maps
        ``(when, role)`` to the same block of each input's raw bits."""
        raise NotImplementedError


class DeltaPredictor(Predictor):
    """``delta`` 1: predicted = the same chunk at step t-1."""

    name, version, roles = "delta", 1, ROLES

    def check(self, c: Coding, where: str) -> None:
        super().check(c, where)
        try:
            size = info_for_name(c.dtype).itemsize
        except Exception:
            raise CorruptStoreError(f"{where}: delta coding of unknown dtype {c.dtype!r}") from None
        if size not in _UINT or c.params:
            raise CorruptStoreError(f"{where}: delta coding of {c.dtype} with {dict(c.params)!r:.100}")

    def needs(self, c: Coding) -> list[Need]:
        return [Need("prev", c.role, c.dtype)]

    def predict(self, c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        np.copyto(out, ins["prev", c.role])


class AdamPredictor(Predictor):
    """``adam`` 1: Adam and AdamW's second moment, its running max, and the parameter."""

    name, version, roles = "adam", 1, ("param", "exp_avg_sq", "max_exp_avg_sq")

    def check(self, c: Coding, where: str) -> None:
        super().check(c, where)
        if c.dtype not in FLOAT_DTYPES:
            raise CorruptStoreError(f"{where}: adam coding of {c.dtype!r}")
        _flag(c, "round", ("op", "end"), where)
        if c.role == "param":
            _flag(c, "state", FLOAT_DTYPES, where)
            _flag(c, "denom", ("exp_avg_sq", "max_exp_avg_sq"), where)
            _consts(c, ("S", "B", "E"), ("WD", "D"), where)
            extra = set(c.params) - {"state", "round", "denom", "c"}
        elif c.role == "exp_avg_sq":
            _flag(c, "grad", FLOAT_DTYPES, where)
            _flag(c, "fresh", (False, True), where)
            _consts(c, ("W", "B2", "C2"), (), where)
            extra = set(c.params) - {"grad", "round", "fresh", "c"}
        else:
            _flag(c, "fresh", (False, True), where)
            extra = set(c.params) - {"round", "fresh"}
        if extra:
            raise CorruptStoreError(f"{where}: adam {c.role} coding has unknown keys {sorted(extra)}")

    def needs(self, c: Coding) -> list[Need]:
        p = c.params
        if c.role == "param":
            st = p["state"]
            return [Need("prev", "param", c.dtype), Need("cur", "exp_avg", st), Need("cur", p["denom"], st)]
        if c.role == "exp_avg_sq":
            prev = [] if p["fresh"] else [Need("prev", "exp_avg", c.dtype), Need("prev", "exp_avg_sq", c.dtype)]
            return [*prev, Need("cur", "exp_avg", c.dtype)]
        prev = [] if p["fresh"] else [Need("prev", "max_exp_avg_sq", c.dtype)]
        return [*prev, Need("cur", "exp_avg_sq", c.dtype)]

    def predict(self, c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        with np.errstate(all="ignore"):
            if c.role == "param":
                self._param(c, ins, out, s)
            elif c.role == "exp_avg_sq":
                self._second_moment(c, ins, out, s)
            else:
                self._running_max(c, ins, out, s)

    @staticmethod
    def _running_max(c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        """``maximum(vmax0, v1)`` as torch.maximum: NaN if either is NaN. Not
        ``np.maximum``, whose choice between +0 and -0 differs between its
        vector and scalar loops: the larger by ``>``, else the first."""
        n = len(out)
        v1 = load(ins["cur", "exp_avg_sq"], c.dtype, s.f[0][:n])
        x = s.f[1][:n]
        if c.params["fresh"]:  # torch starts from zeros
            x.fill(0.0)
        elif c.dtype == "float32":
            np.copyto(x, ins["prev", "max_exp_avg_sq"].view(np.float32))
        else:
            load(ins["prev", "max_exp_avg_sq"], c.dtype, x)
        mask = s.mask[:n]
        np.greater(v1, x, out=mask)
        np.copyto(x, v1, where=mask)
        np.isnan(v1, out=mask)
        np.copyto(x, v1, where=mask)
        store(x, c.dtype, out, s)

    @staticmethod
    def _param(c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        n = len(out)
        p = c.params
        k = c.consts()
        st, op = p["state"], p["round"] == "op"
        f0, f1, f2, f3 = (b[:n] for b in s.f)
        x = load(ins["prev", "param"], c.dtype, f0)
        if "WD" in k:
            np.multiply(x, k["WD"], out=f0)
            x = f0
            if op:
                round_to(x, c.dtype, s)
        d = f1
        np.sqrt(load(ins["cur", p["denom"]], st, f1), out=d)
        for name, ufunc in (("B", np.divide), ("E", np.add), ("D", np.divide)):
            if op:
                round_to(d, st, s)
            if name in k:
                ufunc(d, k[name], out=d)
        if op:
            round_to(d, st, s)
        u = f2
        np.multiply(load(ins["cur", "exp_avg"], st, f3), k["S"], out=u)
        np.divide(u, d, out=u)
        np.add(x, u, out=u)
        store(u, c.dtype, out, s)

    @staticmethod
    def _second_moment(c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        n = len(out)
        p = c.params
        k = c.consts()
        f0, f1, f2, f3 = (b[:n] for b in s.f)
        g = f0
        m1 = load(ins["cur", "exp_avg"], c.dtype, f1)
        if p["fresh"]:  # torch starts from zeros: m0 = v0 = 0
            np.divide(m1, k["W"], out=g)
            a = s.zero[:n].view(np.float32)
        else:
            m0 = load(ins["prev", "exp_avg"], c.dtype, f2)
            np.subtract(m1, m0, out=g)
            np.divide(g, k["W"], out=g)
            np.add(g, m0, out=g)
            a = f1
            np.multiply(load(ins["prev", "exp_avg_sq"], c.dtype, f3), k["B2"], out=a)
            if p["round"] == "op":
                round_to(a, c.dtype, s)
        round_to(g, p["grad"], s)  # the gradient was a tensor of that dtype
        cg = f2
        np.multiply(g, k["C2"], out=cg)
        fma(cg, g, a, f3, s)
        store(f3, c.dtype, out, s)


class SgdPredictor(Predictor):
    """``sgd`` 1: SGD with momentum (optionally nesterov): the parameter."""

    name, version, roles = "sgd", 1, ("param",)

    def check(self, c: Coding, where: str) -> None:
        super().check(c, where)
        if c.dtype not in FLOAT_DTYPES:
            raise CorruptStoreError(f"{where}: sgd coding of {c.dtype!r}")
        _flag(c, "state", FLOAT_DTYPES, where)
        _flag(c, "round", ("op", "end"), where)
        nesterov = _flag(c, "nesterov", (False, True), where)
        if nesterov:
            _flag(c, "grad", FLOAT_DTYPES, where)
        _consts(c, ("A", "MOM", "DMP", "MN") if nesterov else ("A",), (), where)
        extra = set(c.params) - {"state", "round", "nesterov", "grad", "c"}
        if extra:
            raise CorruptStoreError(f"{where}: sgd coding has unknown keys {sorted(extra)}")

    def needs(self, c: Coding) -> list[Need]:
        st = c.params["state"]
        prev = [Need("prev", "momentum_buffer", st)] if c.params["nesterov"] else []
        return [Need("prev", "param", c.dtype), *prev, Need("cur", "momentum_buffer", st)]

    def predict(self, c: Coding, ins: Mapping[tuple[str, str], np.ndarray], out: np.ndarray, s: Scratch) -> None:
        n = len(out)
        p = c.params
        k = c.consts()
        st, op = p["state"], p["round"] == "op"
        f0, f1, f2, f3 = (b[:n] for b in s.f)
        with np.errstate(all="ignore"):
            b1 = load(ins["cur", "momentum_buffer"], st, f1)
            d = b1
            if p["nesterov"]:  # grad = (b1 - b0*mom) / (1 - dampening); d = grad + mom * b1
                a = f2
                np.multiply(load(ins["prev", "momentum_buffer"], st, f2), k["MOM"], out=a)
                if op:
                    round_to(a, st, s)
                g = f0
                np.subtract(b1, a, out=g)
                np.divide(g, k["DMP"], out=g)
                round_to(g, p["grad"], s)
                fma(b1, k["MN"], g, f2, s)
                d = f2
                if op:
                    round_to(d, c.dtype, s)
            x = load(ins["prev", "param"], c.dtype, f0)
            fma(d, k["A"], x, f3, s)
            store(f3, c.dtype, out, s)


_REGISTRY: dict[tuple[str, int], Predictor] = {
    (p.name, p.version): p for p in (DeltaPredictor(), AdamPredictor(), SgdPredictor())}


def predictor(name: str, version: int) -> Predictor:
    """The registered predictor ``name`` at ``version``; a store written
    with one this dstt does not know is refused, never decoded."""
    p = _REGISTRY.get((name, version)) if isinstance(name, str) and type(version) is int else None
    if p is None:
        known = ", ".join(f"{n} {v}" for n, v in sorted(_REGISTRY))
        raise FormatVersionError(f"unknown predictor {name!r} version {version!r} (this dstt knows {known}): "
                                 "written by a newer dstt?")
    return p


def registered() -> list[tuple[str, int]]:
    """Every (name, version) this dstt decodes."""
    return sorted(_REGISTRY)


__all__ = ["BLOCK", "CANONICAL_NAN", "Coding", "FLOAT_DTYPES", "Need", "Predictor", "ROLES", "Scratch",
           "as_f32_const", "check_ieee", "fma", "load", "predictor", "registered", "round_to", "store"]
