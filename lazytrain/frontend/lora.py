"""LoRA adapters through PEFT: the ``--lora r=16,alpha=32,targets=q_proj,k_proj,...[,dropout=0]`` setting, parsed
(without torch), and a Hugging Face model wrapped with ``peft.get_peft_model``.

The wrapped model is what is traced, compiled and trained: PEFT freezes the base (``requires_grad=False``), so the
trace marks its parameters frozen (``ParamSpec.trainable``) and the plan streams them without a gradient, an
optimizer state or an update; the adapters (``...lora_A.default.weight``, ``...lora_B.default.weight``) are the
trained state.  PEFT builds its adapter layers on the device of the layer they wrap, so a base built on the meta
device (a compile of a preset) gets meta adapters too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: the Llama family's linear layers: every projection of attention and MLP
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """A LoRA configuration: rank, scale numerator (``alpha / r`` scales the update), the module names it adapts,
    and dropout on the adapters' input (0: the plan's recomputation is exact without replaying a generator)."""

    r: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ALL_LINEAR
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"lora r must be a positive integer, got {self.r!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError("lora targets must name at least one module (e.g. targets=q_proj,v_proj)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    def __str__(self) -> str:
        drop = f",dropout={self.dropout:g}" if self.dropout else ""
        return f"r={self.r},alpha={self.alpha:g},targets={','.join(self.targets)}{drop}"


def parse_lora(spec) -> LoraSpec | None:
    """``spec`` as a ``LoraSpec``: one already, a mapping (a config file's ``lora:``), or the flag's text
    ``r=16,alpha=32,targets=q_proj,k_proj[,dropout=0]`` (``targets`` takes the names after it up to the next
    ``key=``; ``targets=all-linear`` is ``ALL_LINEAR``); None or ``""`` or ``"none"``: no LoRA."""
    if spec is None or isinstance(spec, LoraSpec):
        return spec
    if isinstance(spec, str):
        if spec.strip().lower() in ("", "none", "off"):
            return None
        fields: dict = {}
        key = None
        for part in spec.split(","):
            part = part.strip()
            if "=" in part:
                key, _, value = part.partition("=")
                key = key.strip()
                fields[key] = [value.strip()] if key == "targets" else value.strip()
            elif key == "targets" and part:
                fields["targets"].append(part)
            elif part:
                raise ValueError(f"--lora {spec!r}: {part!r} is not key=value (r=16,alpha=32,targets=q_proj,v_proj)")
        spec = fields
    if not isinstance(spec, dict):
        raise ValueError(f"lora must be r=..,alpha=..,targets=.. or a mapping of them, got {spec!r}")
    unknown = set(spec) - {"r", "alpha", "targets", "dropout"}
    if unknown:
        raise ValueError(f"lora: unknown key {sorted(unknown)[0]!r} (keys: r, alpha, targets, dropout)")
    targets = spec.get("targets", ALL_LINEAR)
    if isinstance(targets, str):
        targets = targets.split(",")
    targets = tuple(t.strip() for t in targets if t.strip())
    if targets in (("all-linear",), ("all_linear",)):
        targets = ALL_LINEAR
    try:
        r = int(spec.get("r", 16))
        alpha = float(spec.get("alpha", 2 * r))
        dropout = float(spec.get("dropout", 0.0))
    except (TypeError, ValueError):
        raise ValueError(f"lora: r must be an integer and alpha, dropout numbers, got {spec!r}") from None
    return LoraSpec(r=r, alpha=alpha, targets=targets, dropout=dropout)


def require_peft():
    """The ``peft`` module, or a one-line error naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise ValueError("LoRA needs the peft package: pip install 'lazytrain[lora]'") from None
    return peft


def wrap(model, spec: LoraSpec):
    """``model`` (a Hugging Face causal LM, real or on the meta device) with LoRA adapters: ``peft.get_peft_model``,
    whose base parameters are frozen.  The adapters are initialised as PEFT does (A random, B zero)."""
    peft = require_peft()
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in spec.targets if t not in names]
    if missing:
        raise ValueError(f"lora targets {', '.join(missing)} name no module of {type(model).__name__} (its layers "
                         f"have e.g. {', '.join(sorted(n for n in names if n.endswith('proj'))[:8]) or 'no *_proj'})")
    cfg = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                          lora_dropout=spec.dropout, bias="none")
    return peft.get_peft_model(model, cfg)
