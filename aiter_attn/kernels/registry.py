"""Kernel registry: op → implementations with frozen capabilities and a priority.

Selection runs once per :class:`KernelRequest` (op, device, dtypes, head dims, page size,
features): it walks candidates by priority, records why each rejected one cannot serve, and
caches the answer. An explicitly requested backend that cannot serve raises with every reason;
an automatic choice falls back to the next candidate. ``AITER_ATTN_BACKEND`` overrides.
"""

from __future__ import annotations

import logging
import numbers
import threading
from typing import Callable, Optional

import attrs
import torch

from ..types import CGSupport
from ..validation import CheckedKernel, checked_kernel, debug_checks_enabled, env_value

__all__ = [
    "Capabilities",
    "KernelImpl",
    "KernelRequest",
    "Selection",
    "KernelRegistry",
    "CheckedRegistry",
    "KernelSelectionError",
    "FEATURES",
]

log = logging.getLogger(__name__)

#: the environment variable that forces a kernel backend by name for every selection
BACKEND_ENV = "AITER_ATTN_BACKEND"


def _env_backend() -> Optional[str]:
    """``AITER_ATTN_BACKEND`` stripped of surrounding whitespace (as ``AITER_ATTN_PLUGINS`` is:
    a value from a ``.env`` file or ``export X=" triton"`` names the same backend); ``None``
    when unset or blank."""
    raw = env_value(BACKEND_ENV)
    return (raw.strip() or None) if raw else None

#: Feature names a request may need and a kernel may declare. ``lse``: the kernel also writes
#: the float32 log-sum-exp per (token, head) (``return_lse=True``; natural log of the exp-sum of
#: the scaled, soft-capped logits, sinks included; ``-inf`` for a fully masked row).
#: ``batch_invariant``: the kernel takes ``batch_invariant=True`` and then computes each row's
#: output bitwise independently of the rest of the batch (``BackendConfig.batch_invariant``).
#: ``kv_scale_per_token_head``: KV writes and attention take ``k_scale_cache``/``v_scale_cache``
#: (float32 ``[pages, page_size, kv_heads]`` per-(token, head) fp8 scales; aiter_attn.kv_scales).
FEATURES = frozenset(
    {"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs", "non_causal",
     "lse", "batch_invariant", "kv_scale_per_token_head"}
)


#: the element type each set-valued field of :class:`Capabilities` holds.
_ELEMENT_TYPES = {"devices": (str, "a device type such as 'cuda'"),
                  "dtypes": (torch.dtype, "a torch.dtype such as torch.float16"),
                  "kv_dtypes": (torch.dtype, "a torch.dtype such as torch.float8_e4m3fn"),
                  "head_dims": (int, "an int"), "page_sizes": (int, "an int"),
                  "features": (str, "a feature name")}


def _frozenset_or_none(v):
    if v is None or isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        # a scalar stays as given (frozenset("cuda") would be its letters: a kernel that is
        # never selected); the post-init refuses it, naming the field
        return v
    return frozenset(v)


def _features(v):
    return frozenset() if v is None else _frozenset_or_none(v)


def _check_device_type(device: str) -> None:
    """A kernel is selected by its inputs' device *type* (``q.device.type``): an index
    (``"cuda:0"``), a capitalised or unknown name (``"CUDA"``, ``"gpu"``) would never match."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"Capabilities(devices=...): {device!r} is not a torch device type "
            f"({str(exc).splitlines()[0]}); use a type such as 'cuda' or 'cpu' (ROCm torch "
            "reports 'cuda' too).") from exc
    if kind != device:
        raise ValueError(
            f"Capabilities(devices=...): {device!r} names a device, not a device type; "
            f"kernels are selected by the inputs' device type, so use {kind!r}.")


def _check_elements(caps) -> None:
    for name, (kind, what) in _ELEMENT_TYPES.items():
        value = getattr(caps, name)
        if value is not None and not isinstance(value, frozenset):
            raise TypeError(
                f"Capabilities({name}={value!r}): {name}={value!r} is a "
                f"{type(value).__name__}, not a set; pass a set, e.g. {name}={{{value!r}}}."
            )
        for x in value or ():
            if not isinstance(x, kind) or isinstance(x, bool):
                raise TypeError(f"Capabilities({name}=...): {name} holds {x!r}; each entry is "
                                f"{what}.")
            if name == "devices":
                _check_device_type(x)


@attrs.frozen(kw_only=True)
class Capabilities:
    """What one implementation can serve. ``None`` means any.

    Attributes:
        devices: device types (``"cpu"``, ``"cuda"``).
        dtypes: query/activation dtypes.
        kv_dtypes: cache dtypes (fp8 ones need ``"fp8"`` in features too).
        head_dims: accepted q/k head dims.
        max_head_dim: upper bound on head dims when ``head_dims`` is ``None``.
        page_sizes: accepted page sizes.
        features: subset of :data:`FEATURES`.
        cg_support: how far it runs under CUDA-graph capture (required, no default: a kernel
            that claims capture gets a second run in the same buffers from ``aiter-attn
            verify``, one that does not is kept out of captured steps).
        predicate: optional extra check ``(request) -> reason or None``.
    """

    devices: Optional[frozenset] = attrs.field(default=None, converter=_frozenset_or_none)
    dtypes: Optional[frozenset] = attrs.field(default=None, converter=_frozenset_or_none)
    kv_dtypes: Optional[frozenset] = attrs.field(default=None, converter=_frozenset_or_none)
    head_dims: Optional[frozenset] = attrs.field(default=None, converter=_frozenset_or_none)
    max_head_dim: Optional[int] = None
    page_sizes: Optional[frozenset] = attrs.field(default=None, converter=_frozenset_or_none)
    features: frozenset = attrs.field(default=frozenset(), converter=_features)
    cg_support: CGSupport = None  # required: checked below with a message that says why
    predicate: Optional[Callable] = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self):
        _check_elements(self)
        if not isinstance(self.cg_support, CGSupport):
            raise TypeError(
                f"Capabilities(cg_support={self.cg_support!r}): state how far the kernel runs "
                "under CUDA-graph capture: cg_support=CGSupport.NEVER (eager only), "
                "CGSupport.UNIFORM_BATCH (captured batches with one query length) or "
                "CGSupport.ALWAYS (any captured batch). There is no default."
            )
        mh = self.max_head_dim
        if mh is not None and (isinstance(mh, bool) or not isinstance(mh, numbers.Integral)
                               or mh < 1):
            raise TypeError(f"Capabilities(max_head_dim={mh!r}): max_head_dim is a positive int "
                            "(the largest head dim served) or None (any).")
        unknown = self.features - FEATURES
        if unknown:
            raise ValueError(
                f"Capabilities(features=...): unknown features {sorted(unknown)}; allowed: "
                f"{sorted(FEATURES)}. Fix the name (an unknown feature is never requested)."
            )

    def reject_reason(self, req: "KernelRequest") -> Optional[str]:
        """Why this cannot serve ``req``, or ``None`` if it can."""
        if self.devices is not None and req.device not in self.devices:
            return f"device {req.device!r} not in {sorted(self.devices)}"
        if self.dtypes is not None and req.dtype is not None and req.dtype not in self.dtypes:
            return f"dtype {req.dtype} not in {sorted(map(str, self.dtypes))}"
        if (
            self.kv_dtypes is not None
            and req.kv_dtype is not None
            and req.kv_dtype not in self.kv_dtypes
        ):
            return f"kv dtype {req.kv_dtype} not in {sorted(map(str, self.kv_dtypes))}"
        for name, dim in (("head_dim", req.head_dim), ("v_head_dim", req.v_head_dim)):
            if dim is None:
                continue
            if self.head_dims is not None and dim not in self.head_dims:
                return f"{name} {dim} not in {sorted(self.head_dims)}"
            if self.max_head_dim is not None and dim > self.max_head_dim:
                return f"{name} {dim} > max {self.max_head_dim}"
        if self.page_sizes is not None and req.page_size is not None:
            if req.page_size not in self.page_sizes:
                return f"page_size {req.page_size} not in {sorted(self.page_sizes)}"
        missing = req.features - self.features
        if missing:
            return f"missing features {sorted(missing)}"
        if self.predicate is not None:
            try:
                reason = self.predicate(req)
            except Exception as exc:  # one kernel's broken predicate must not stop selection
                log.warning("Capabilities.predicate raised for %s", req, exc_info=True)
                return (f"predicate raised {type(exc).__name__}: {exc}; it must return a reason "
                        "(str) or None for every request")
            if reason is not None and not isinstance(reason, str):
                return (f"predicate returned {reason!r}; it must return a reason (str) when the "
                        "kernel cannot serve the request and None when it can")
            if reason is not None and not reason.strip():
                return (f"predicate returned an empty reason ({reason!r}); return a sentence "
                        "saying why the kernel cannot serve the request, or None when it can")
            return reason
        return None


def _request_features(v):
    if isinstance(v, (str, bytes)):
        raise TypeError(f"KernelRequest(features={v!r}): a bare string would be read as its "
                        f"letters; pass a set of feature names, e.g. features={{{v!r}}}.")
    features = frozenset() if v is None else frozenset(v)
    unknown = features - FEATURES
    if unknown:
        # no kernel can declare an unknown feature: every one would be rejected for "missing"
        # it, and the error would blame the kernels instead of the request's typo
        raise ValueError(f"KernelRequest(features={sorted(features, key=str)}): unknown "
                         f"features {sorted(unknown, key=str)}; allowed: {sorted(FEATURES)}. "
                         "Fix the name (no kernel can declare an unknown feature).")
    return features


@attrs.frozen(kw_only=True)
class KernelRequest:
    """The selection key: what a call site needs from an op."""

    op: str
    device: str = "cpu"
    dtype: Optional[torch.dtype] = None
    kv_dtype: Optional[torch.dtype] = None
    head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    page_size: Optional[int] = None
    features: frozenset = attrs.field(default=frozenset(), converter=_request_features)
    extra: tuple = ()  # op-specific hashable details (e.g. MLA head count)


@attrs.frozen(kw_only=True)
class KernelImpl:
    """One registered implementation of an op.

    Attributes:
        fn: the functional convenience (the op's keyword calling convention).
        kernel_cls: for attention ops, the :class:`~aiter_attn.kernels.base.AttentionKernel`
            class that :meth:`bind` instantiates (a registered function is adapted by
            :class:`~aiter_attn.kernels.base.FunctionKernel`); ``None`` for other ops.
    """

    op: str
    name: str
    fn: Callable = attrs.field(eq=False)
    capabilities: Capabilities
    priority: int = 0
    source: str = "builtin"  # the plugin that registered it
    kernel_cls: Optional[type] = attrs.field(default=None, eq=False)

    def bind(self, request: Optional["KernelRequest"] = None):
        """A kernel object for ``request`` (attention ops): plan/run from here on."""
        if self.kernel_cls is None:
            raise TypeError(f"op {self.op!r} ({self.name}) is a plain function, not a kernel "
                            "object; call impl.fn.")
        return self.kernel_cls(request)


@attrs.frozen
class Selection:
    """Result of a selection: the implementation and why the others were passed over."""

    impl: KernelImpl
    rejected: tuple = ()  # ((name, reason), ...)
    check_values: bool = False  # the checked mode (see :meth:`checked`)

    @property
    def fn(self) -> Callable:
        if self.check_values:
            return checked_kernel(self.impl.op, self.impl.fn)
        return self.impl.fn

    def bind(self, request: Optional["KernelRequest"] = None):
        """The chosen implementation bound as a kernel object (see :meth:`KernelImpl.bind`);
        in the checked mode wrapped in :class:`~aiter_attn.validation.CheckedKernel`."""
        kernel = self.impl.bind(request)
        return CheckedKernel(kernel) if self.check_values else kernel

    def checked(self) -> "Selection":
        """This selection in the checked mode: its kernel (``fn`` and :meth:`bind`) runs the
        op's value checks first (:mod:`aiter_attn.validation`; they sync). Idempotent."""
        return self if self.check_values else attrs.evolve(self, check_values=True)


def _check_registration(op, name, fn, priority) -> None:
    """Refuse a registration that would break selection later (for every caller of ``op``:
    candidates are sorted by ``(-priority, name)``), naming the argument and the fix."""
    for arg, value in (("op", op), ("name", name)):
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"register(op={op!r}, name={name!r}, ...): {arg}={value!r}; {arg} "
                            "is a non-empty str (the backend name users select for a name).")
        if value != value.strip():
            # AITER_ATTN_BACKEND is read stripped: such a name could never be forced by it
            raise ValueError(f"register(op={op!r}, name={name!r}, ...): {arg}={value!r} has "
                             f"surrounding whitespace; pass {value.strip()!r}.")
    if not callable(fn):
        raise TypeError(f"register({op!r}, {name!r}, fn={fn!r}): fn is a "
                        f"{type(fn).__name__}, not callable; pass the kernel function or an "
                        "AttentionKernel subclass.")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"register({op!r}, {name!r}, ..., priority={priority!r}): priority is "
                        "an int (higher wins; reference 0, triton 100, aiter 150), got a "
                        f"{type(priority).__name__}.")


class KernelSelectionError(ValueError):
    """No implementation can serve a request; the message lists every candidate's reason."""


def _builtin(source: str) -> bool:
    """Whether ``source`` is one of the package's own plugins (or a direct registration)."""
    from ..plugins import CORE_PLUGINS, OPTIONAL_PLUGINS

    return source == "builtin" or source in CORE_PLUGINS or source in OPTIONAL_PLUGINS


class KernelRegistry:
    """Op → implementations. Thread-safe registration; cached selection."""

    def __init__(self):
        self._impls: dict[str, dict[str, KernelImpl]] = {}
        self._cache: dict = {}
        self._bound: dict = {}
        #: the ops' call memo (``aiter_attn.ops``): cheap call key -> what the validated,
        #: selected and planned call needs to run again; cleared with the selections
        self.calls: dict = {}
        self._lock = threading.Lock()

    def register(
        self,
        op: str,
        name: str,
        fn: Callable,
        capabilities: Capabilities,
        priority: int = 0,
        *,
        source: str = "builtin",
        replace: bool = False,
    ) -> KernelImpl:
        """Register ``fn`` as backend ``name`` of ``op`` with its ``capabilities`` (which
        state ``cg_support``).

        For the attention ops (:data:`~aiter_attn.kernels.base.ATTENTION_OPS`) ``fn`` may be
        an :class:`~aiter_attn.kernels.base.AttentionKernel` subclass (plan/run) or a
        function in the keyword convention (adapted). A name already registered for the op
        raises unless ``replace=True`` (a plugin that deliberately overrides a built-in says
        so).
        """
        from .base import ATTENTION_OPS, AttentionKernel, MLAKernel, function_kernel

        _check_registration(op, name, fn, priority)
        if not isinstance(capabilities, Capabilities):
            raise TypeError(
                f"register({op!r}, {name!r}, ..., capabilities={capabilities!r}): capabilities "
                f"is a {type(capabilities).__name__}; pass an "
                "aiter_attn.kernels.registry.Capabilities(...) instance (it states at least "
                "cg_support)."
            )
        kernel_cls = None
        if isinstance(fn, type) and issubclass(fn, AttentionKernel):
            if op not in ATTENTION_OPS:
                raise TypeError(f"{fn.__name__} is a kernel object but op {op!r} takes a "
                                f"function; kernel objects serve {sorted(ATTENTION_OPS)}.")
            # the functional convenience is the base's __call__: MLA's takes (q, kv_cache,
            # out, kv_lora_rank=…), the others (q, k_cache, v_cache, out, …)
            if (op == "mla_paged_attention") != issubclass(fn, MLAKernel):
                want = "MLAKernel" if op == "mla_paged_attention" else "AttentionKernel"
                raise TypeError(
                    f"register({op!r}, {name!r}, {fn.__name__}): op {op!r} takes a subclass "
                    f"of aiter_attn.kernels.base.{want}, and {fn.__name__} "
                    f"{'is not one' if want == 'MLAKernel' else 'is an MLAKernel'}; derive it "
                    f"from {want} or register it for the op it implements.")
            base = fn
        elif op in ATTENTION_OPS:
            base = function_kernel(fn, op)
        else:
            base = None
        if base is not None:
            # one subclass per registration: the name and capabilities travel with it
            kernel_cls = type(base.__name__, (base,),
                              {"name": name, "op": op, "capabilities": capabilities})
            if fn is base:
                fn = kernel_cls()  # the functional convenience: plan + run in one call
        impl = KernelImpl(
            # a plain int: numpy integers sort alike but are no JSON number (aiter-attn info)
            op=op, name=name, fn=fn, capabilities=capabilities, priority=int(priority),
            source=source,
            kernel_cls=kernel_cls,
        )
        with self._lock:
            table = self._impls.setdefault(op, {})
            if name in table and not replace:
                raise ValueError(
                    f"kernel {name!r} is already registered for op {op!r} "
                    f"(by {table[name].source}); pass replace=True to override it."
                )
            if name in table and table[name].source != source and not _builtin(
                    table[name].source):
                # two plugins overriding one name: the later in load order wins (built-ins,
                # then entry points by name), so say which (a built-in's override is the
                # deliberate case replace=True is for)
                log.warning("kernel %r of op %r registered by %s is replaced by %s's "
                            "(replace=True); plugins load built-ins first, then entry points "
                            "in name order", name, op, table[name].source, source)
            table[name] = impl
            self._cache.clear()
            self._bound.clear()
            self.calls.clear()
        return impl

    def ops(self) -> list[str]:
        return sorted(self._impls)

    def implementations(self, op: str) -> list[KernelImpl]:
        """Implementations of ``op``, best first."""
        return sorted(self._impls.get(op, {}).values(), key=lambda i: (-i.priority, i.name))

    def bound(self, key, request, backend: Optional[str] = None):
        """A kernel object bound for ``request``, cached on the caller's cheap hashable ``key``
        (which must determine the request). ``request`` is a :class:`KernelRequest` or a
        zero-argument callable building one, so a cache hit builds and hashes nothing."""
        forced = _env_backend() if backend is None else backend
        full = (key, forced, debug_checks_enabled())  # the checked mode binds its own
        hit = self._bound.get(full)
        if hit is None:
            req = request() if callable(request) else request
            # the argument as given: a backend from the environment is named as such in errors
            hit = self.select(req, backend=backend).bind(req)
            self._bound[full] = hit
        return hit

    def select(self, request: KernelRequest, backend: Optional[str] = None, *,
               fallback: bool = False) -> Selection:
        """Pick the best implementation for ``request`` (cached per request and backend).

        ``backend`` (or ``AITER_ATTN_BACKEND``) forces one by name; if it cannot serve, raises
        :class:`KernelSelectionError` with the reason, unless ``fallback=True``: then the
        best implementation that can serve is chosen instead (the KV writes of a strategy
        whose backend is a plugin that registers attention only). Under
        ``AITER_ATTN_DEBUG=1`` the selection is :meth:`Selection.checked`.
        """
        sel = self._select(request, backend, fallback)
        return sel.checked() if debug_checks_enabled() else sel

    def _select(self, request: KernelRequest, backend: Optional[str],
                fallback: bool) -> Selection:
        origin = "backend"
        if backend is None:
            backend, origin = _env_backend(), BACKEND_ENV
        if fallback and backend is not None:
            try:
                return self._pick(request, backend, origin)
            except KernelSelectionError as exc:
                # the automatic choice: not ``select(request, None)``, which would read
                # AITER_ATTN_BACKEND again and force the same backend
                sel = self._pick(request, None)
                log.debug("op %s: backend %r cannot serve it (%s); using %s", request.op,
                          backend, exc, sel.impl.name)
                return sel
        return self._pick(request, backend, origin)

    def _pick(self, request: KernelRequest, backend: Optional[str],
              origin: str = "backend") -> Selection:
        """The cached selection for ``request`` with ``backend`` already resolved (``None``:
        the automatic choice, whatever the environment says); ``origin`` names where a forced
        backend came from in errors (``"backend"``: the argument, or ``AITER_ATTN_BACKEND``)."""
        key = (request, backend)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        candidates = self.implementations(request.op)
        if not candidates:
            raise KernelSelectionError(
                f"no kernel is registered for op {request.op!r}; registered ops: {self.ops()}. "
                "Is the plugin that provides it installed and allowed (AITER_ATTN_PLUGINS)?"
            )
        rejected = []
        chosen = None
        for impl in candidates:
            if backend is not None and impl.name != backend:
                rejected.append((impl.name, f"not the requested backend {backend!r}"))
                continue
            reason = impl.capabilities.reject_reason(request)
            if reason is None:
                chosen = impl
                break
            rejected.append((impl.name, reason))
        if chosen is None:
            raise KernelSelectionError(self._no_kernel_message(request, candidates, rejected,
                                                               backend, origin))
        sel = Selection(chosen, tuple(rejected))
        if rejected:
            log.debug("op %s: chose %s; rejected %s", request.op, chosen.name, rejected)
        self._cache[key] = sel
        return sel

    @staticmethod
    def _no_kernel_message(request, candidates, rejected, backend, origin) -> str:
        """Why nothing was chosen and what to do: a forced backend is named as it was given
        (``backend=`` or ``AITER_ATTN_BACKEND``), with the kernels that would serve instead."""
        names = [i.name for i in candidates]
        forced = f"{origin}={backend!r}"
        from_env = origin == BACKEND_ENV
        if backend is not None and backend not in names:
            fix = (f"Set {BACKEND_ENV} to one of those, unset it for the automatic choice, or "
                   "install the plugin that provides it." if from_env else
                   "Pick one of those or install the plugin that provides it.")
            return (f"{forced} has no kernel for op {request.op!r}; available: {names}. {fix}")
        if backend is None:
            detail = "; ".join(f"{n}: {r}" for n, r in rejected)
            return (f"no kernel can serve {request.op!r} for {request}: {detail}. "
                    "Change the layer/config or pick a backend that supports it.")
        # a forced backend that cannot serve: the others' own reasons, not "not requested"
        own = dict(rejected)[backend]
        others = [(i.name, i.capabilities.reject_reason(request)) for i in candidates
                  if i.name != backend]
        serving = [n for n, r in others if r is None]
        detail = "; ".join([f"{backend}: {own}"] + [f"{n}: {r}" for n, r in others if r])
        msg = f"no kernel can serve {request.op!r} for {request}: {detail}."
        if not serving:
            return msg + " Change the layer/config or pick a backend that supports it."
        fix = (f"unset {BACKEND_ENV} (the automatic choice) or set it to one of those"
               if from_env else "pass backend=None (the automatic choice) or one of those")
        return (f"{msg} {forced} forces {backend!r}; {serving} can serve it: {fix}, or "
                "change the layer/config.")


class CheckedRegistry:
    """A view of a :class:`KernelRegistry` whose selections are :meth:`Selection.checked`
    (what ``BackendConfig(debug_checks=True)`` gives one backend); everything else is the
    registry's own."""

    def __init__(self, registry):
        self.registry = registry

    def select(self, request: KernelRequest, backend: Optional[str] = None,
               **kwargs) -> Selection:
        return self.registry.select(request, backend=backend, **kwargs).checked()

    def __getattr__(self, name):
        return getattr(self.registry, name)
