"""The memory tiers as one table: where each is budgeted, what prices and runs a copy into or out of it, and
what holds it at run time.

Every tier but the host copies to and from the host (``TierSpec.via``): the GPU over PCIe, NVMe through files.
A value moves between two other tiers through the host (``path``).  ``verify``'s memory walk keeps one use and
peak per row, the budgets it checks are the rows' ``budget`` fields, the cost model prices a copy with the
bandwidth fields of its row (``copy_rate``), the lowering emits each hop on ``copy_resource``, and the runtime
keys its copy and free handlers by tier (``runtime/handlers.py``).  ``docs/architecture.md``, "How to add a
tier", lists the places a new row needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops import OpKind, Resource, Tier


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSpec:
    """One tier.  ``into_*`` describe a copy from ``via`` into this tier, ``out_*`` one from this tier to
    ``via``; the host, which every copy goes through, has none."""

    tier: Tier
    #: the tier's name in messages ("peak NVMe memory ..."), and as a noun ("moves between the GPU and NVMe")
    label: str
    noun: str
    #: the field of the compile's budget record (``Plan.budgets``) its peak is checked against
    budget: str
    #: the field of ``verify.MemoryReport`` that holds its peak
    peak: str
    #: the runtime store that holds its copies (a field of ``runtime.context.Run``): the compute device's
    #: memory, the pooled host buffers, the NVMe folder
    store: str
    #: the tier it copies to and from (None: the host itself)
    via: Tier | None = None
    #: the hardware profile's bandwidth fields (GB/s) that price a copy into / out of it
    into_gbps: str = ""
    out_gbps: str = ""
    #: the resource (stream or worker) a copy into / out of it runs on
    into_resource: Resource = Resource.NONE
    out_resource: Resource = Resource.NONE
    #: its copies and frees run on a host worker thread, not from the issuing thread (file I/O)
    on_worker: bool = False


TIERS: dict[Tier, TierSpec] = {
    Tier.GPU: TierSpec(tier=Tier.GPU, label="GPU", noun="the GPU", budget="gpu_bytes", peak="peak_gpu_bytes",
                       store="device", via=Tier.HOST, into_gbps="h2d_gbps", out_gbps="d2h_gbps",
                       into_resource=Resource.H2D, out_resource=Resource.D2H),
    Tier.HOST: TierSpec(tier=Tier.HOST, label="host", noun="the host", budget="host_bytes", peak="peak_host_bytes",
                        store="pool"),
    Tier.NVME: TierSpec(tier=Tier.NVME, label="NVMe", noun="NVMe", budget="nvme_bytes", peak="peak_nvme_bytes",
                        store="nvme", via=Tier.HOST, into_gbps="nvme_write_gbps", out_gbps="nvme_read_gbps",
                        into_resource=Resource.NVME, out_resource=Resource.NVME, on_worker=True),
}


@dataclass(frozen=True, slots=True)
class Copy:
    """One hop of a move between two tiers: the op kind (an ``offload`` leads away from the GPU, a ``reload``
    towards it), the resource it runs on and the profile's bandwidth field that prices it."""

    src: Tier
    dst: Tier
    kind: OpKind
    resource: Resource
    gbps: str


def _copies() -> dict[tuple[Tier, Tier], Copy]:
    out = {}
    for spec in TIERS.values():
        if spec.via is None:
            continue
        toward_gpu = spec.tier is Tier.GPU      # the host is one hop from every tier: the GPU is the nearer end
        out[(spec.via, spec.tier)] = Copy(spec.via, spec.tier, OpKind.RELOAD if toward_gpu else OpKind.OFFLOAD,
                                          spec.into_resource, spec.into_gbps)
        out[(spec.tier, spec.via)] = Copy(spec.tier, spec.via, OpKind.OFFLOAD if toward_gpu else OpKind.RELOAD,
                                          spec.out_resource, spec.out_gbps)
    return out


#: every copy one op makes, keyed by (source, destination)
COPIES: dict[tuple[Tier, Tier], Copy] = _copies()


def copy(src: Tier, dst: Tier) -> Copy:
    """The one-op copy from ``src`` to ``dst`` (KeyError: the two are not one hop apart)."""
    return COPIES[(src, dst)]


def path(src: Tier, dst: Tier) -> tuple[Copy, ...]:
    """The copies that move a value from ``src`` to ``dst``, through the host where neither is it."""
    if src is dst:
        return ()
    if (src, dst) in COPIES:
        return (COPIES[(src, dst)],)
    return (COPIES[(src, Tier.HOST)], COPIES[(Tier.HOST, dst)])


def copy_rate(hw, c: Copy) -> float:
    """Bytes per second of copy ``c`` on hardware profile ``hw``."""
    return getattr(hw, c.gbps) * 1e9
