"""How much of the training states the optimizer's device holds: the choices of ``optimizer_on``, the bytes they
take there, and which groups a share of them is (:mod:`~lightning_roundpipe.runtime.resident` keeps them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.profile import TransferRate

if TYPE_CHECKING:
    from lightning_roundpipe.runtime.resident import ResidentStates

OPTIMIZER_PLACES = ("host", "device", "auto")
AUTO_SHARE = 0.5
"""``optimizer_on="auto"`` keeps the states on the device when they take at most this share of what it may use."""
SHARE_FLOOR = 0.1
"""The least share ``"auto"`` moves to the device where the host's step bounds the step (:func:`share_for`): a
smaller one takes little off the host and still halves what the plan may use."""
STATES_MOST = 0.8
"""The most of a device's limit its resident states may take: the plan's stages need the rest."""
SHARE_TARGET = 0.8
"""What ``"auto"``'s share brings the host's step to, of the devices' (the smaller plan the states leave makes the
devices slower)."""
STATE_BYTES = 8
"""The optimizer's state bytes a parameter planned for: AdamW's two fp32 moments (amsgrad's third, or a kernel's
temporaries, come on top)."""


def resident_bytes(store: HostStore, state_bytes_per_parameter: int = STATE_BYTES, groups: Any = None) -> int:
    """Device bytes the resident states of ``groups`` (default: every trainable one) take: masters, gradients,
    two compute copies, and the optimizer's states (planned at :data:`STATE_BYTES` a parameter; they exist from
    the first update on)."""
    total = 0
    for group in store.groups:
        if group.trainable and (groups is None or group.index in groups):
            n = group.data.numel()
            total += n * (2 * group.data.element_size() + 2 * group.compute.element_size() + state_bytes_per_parameter)
    return total


def deepest_share(store: HostStore, share: float) -> tuple[int, ...]:
    """The deepest trainable groups holding at most ``share`` of the trainable parameters (at least one): their
    gradients complete first in a backward, so their updates on the device start first and the host's math on the
    shallower ones follows as theirs complete."""
    trainable = [g for g in store.groups if g.trainable]
    total, held, taken = sum(g.data.numel() for g in trainable), 0, []
    for group in reversed(trainable):
        if taken and held + group.data.numel() > share * total:
            break
        taken.append(group.index)
        held += group.data.numel()
    return tuple(sorted(taken))


def share_for(store: HostStore, memory_limit: float | None, host_s: float, device_s: float) -> float | None:
    """The share of the trainable parameters whose states ``"auto"`` moves to the device when its host step
    (``host_s``) is longer than the devices' (``device_s``): the host's work that brings it to
    :data:`SHARE_TARGET` of theirs, at most what fits in :data:`AUTO_SHARE` of the device's limit; ``None`` where
    that is under :data:`SHARE_FLOOR` (the host's step then stays and bounds the step)."""
    states = resident_bytes(store)
    if memory_limit is None or states <= 0 or host_s <= 0:
        return None
    share = min(1.0 - SHARE_TARGET * device_s / host_s, AUTO_SHARE * memory_limit / states)
    return share if share >= SHARE_FLOOR else None


def place_states(
    optimizer_on: str | float,
    store: HostStore,
    devices: Any,
    eligible: bool,
    memory_limit: float | None,
    transfers: TransferRate | None = None,
) -> ResidentStates | None:
    """The states on the device where ``optimizer_on`` says so, else ``None`` (the host). ``"auto"``: on the
    device with one worker device, an engine that could (``eligible``: the asynchronous layerwise optimizer, no
    fp16 autocast and so no loss scaling), a memory limit (a GPU), and states within :data:`AUTO_SHARE` of it.
    A number in (0, 1): that share of the trainable parameters, the deepest groups', on the device, the rest's on
    the host (where the host's step bounds the step and not every state fits)."""
    from lightning_roundpipe.runtime.resident import ResidentStates  # (it imports this module)

    if optimizer_on == "host":
        return None
    if not isinstance(optimizer_on, str):
        return ResidentStates(store, devices[0], transfers, deepest_share(store, float(optimizer_on)))
    fits = memory_limit is not None and resident_bytes(store) <= AUTO_SHARE * memory_limit
    if optimizer_on == "auto" and not (len(devices) == 1 and eligible and fits):
        return None
    return ResidentStates(store, devices[0], transfers)
