"""Before a run whose plan keeps training state on NVMe: the drive measured as the tier uses it, against the rates
the plan was priced at.  A drive much slower than the profile says (a network volume, a SATA disk, a full SSD
writing at its steady-state rate) still trains correctly, only slower; the user hears it before the first step,
with the step it implies and how to plan for it, not after an hour of slow steps."""

from __future__ import annotations

#: a drive measured below this share of the plan's read or write rate is worth a warning [ledger: slow-disk-share]
SLOW_SHARE = 0.5
#: the file the check reads and writes: ~0.2 s on a PCIe 4 drive
PROBE_BYTES = 256 << 20


def slow_disk_warning(plan, folder: str) -> str | None:
    """A warning when the drive at ``folder`` reads or writes at less than ``SLOW_SHARE`` of the rates ``plan``
    was priced at, with the step the measured rates imply; None when it keeps up, or the plan keeps no state
    there."""
    if not plan.decisions.nvme_state:
        return None
    from ..measure.disk import disk_rates
    hw, pred = plan.hardware, plan.predicted or {}
    got = disk_rates(folder, PROBE_BYTES)
    want_r, want_w = float(hw.get("nvme_read_gbps") or 0), float(hw.get("nvme_write_gbps") or 0)
    r, w = got["nvme_read_gbps"], got["nvme_write_gbps"]
    if not want_r or not want_w or (r >= SLOW_SHARE * want_r and w >= SLOW_SHARE * want_w):
        return None
    busy = float(pred.get("busy_s", {}).get("nvme", 0.0))
    slower = busy * max(want_r / r, want_w / w)       # (an upper bound on the NVMe lane's time at these rates)
    step = float(pred.get("step_time_s", 0.0))
    return (f"lazytrain: warning: the drive at {folder} measured {r:.2f} GB/s read, {w:.2f} GB/s write; the plan "
            f"was priced at {want_r:.2f} / {want_w:.2f} GB/s ({hw.get('name')}). Its NVMe traffic would take up to "
            f"{slower:.0f} s a step instead of {busy:.0f} s (predicted step {step:.0f} s): `lazytrain profile "
            f"--disk-dir {folder} -o hw.json` and --hardware hw.json plan for this drive, or give --nvme-dir on a "
            "faster one")
