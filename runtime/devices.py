"""Device profiles: the facts about a target GPU that planning depends on.

AOT builds run on machines without the target GPU, so nothing here is read from
a live device; the runtime matches the live device to one of these profiles at
load time.  All values in one place, as data.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # profile id used in specs, e.g. "h200"
    arch: str  # CuTeDSL / ptxas target, e.g. "sm_90a"
    compute_capability: tuple[int, int]
    sm_count: int
    max_shared_memory_per_block_optin: int  # bytes a block may opt in to
    shared_memory_per_sm: int  # bytes
    registers_per_sm: int
    max_threads_per_sm: int
    device_names: tuple[str, ...]  # substrings of the CUDA device name that identify it

    @property
    def planning_facts(self) -> tuple:
        """Everything that may change a kernel choice or launch; equal facts plan equally."""
        return (
            self.arch,
            self.sm_count,
            self.max_shared_memory_per_block_optin,
            self.shared_memory_per_sm,
            self.registers_per_sm,
            self.max_threads_per_sm,
        )


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("h100", "sm_90a", (9, 0), 132, 227 * KIB, 228 * KIB, 65536, 2048, ("H100",)),
        DeviceProfile("h200", "sm_90a", (9, 0), 132, 227 * KIB, 228 * KIB, 65536, 2048, ("H200",)),
        DeviceProfile("b200", "sm_100a", (10, 0), 148, 227 * KIB, 228 * KIB, 65536, 2048, ("B200",)),
        DeviceProfile(
            "rtx-pro-6000", "sm_120a", (12, 0), 188, 99 * KIB, 100 * KIB, 65536, 1536, ("RTX PRO 6000",)
        ),
        DeviceProfile("gb10", "sm_121a", (12, 1), 48, 99 * KIB, 100 * KIB, 65536, 1536, ("GB10",)),
    )
}


def match_profile(
    candidates: list[DeviceProfile], *, name: str, capability: tuple[int, int], sm_count: int
) -> DeviceProfile | None:
    """The profile among `candidates` that describes a live device, or None.

    Architecture and SM count must match exactly (a different SM count changes
    persistent grids).  Among equal matches the one whose name appears in the
    device name wins; otherwise the first of profiles with identical planning facts.
    """
    same = [p for p in candidates if p.compute_capability == capability and p.sm_count == sm_count]
    if not same:
        return None
    named = [p for p in same if any(s.lower() in name.lower() for s in p.device_names)]
    if named:
        return named[0]
    if len({p.planning_facts for p in same}) == 1:
        return same[0]
    return None
