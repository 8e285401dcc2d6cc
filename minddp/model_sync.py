"""Start-up agreement between ranks: same model, same settings, same weights.

torch DDP checks the model on each rank separately, so a mismatch can make
some ranks raise and leave the others hanging. Here every rank gathers every
rank's description first, so all of them see the same mismatch and raise the
same error.
"""
import torch
import torch.distributed as dist


class ModelMismatch(RuntimeError):
    """The ranks' models or wrapper settings differ (raised on every rank)."""


def describe(named_params, settings):
    """A small picklable description of a model and its wrapper settings."""
    return {"params": [(n, tuple(p.shape), str(p.dtype), p.stride()) for n, p in named_params],
            "settings": settings}


def _first_difference(mine, theirs):
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return k, a, b
    k = min(len(mine), len(theirs))
    return k, mine[k] if k < len(mine) else None, theirs[k] if k < len(theirs) else None


def _show(param):
    if param is None:
        return "no parameter there"
    name, shape, dtype, strides = param
    return f"'{name}' of shape {list(shape)}, dtype {dtype} and strides {strides}"


def check_same_model(named_params, settings, group, failed=False):
    """Raise the same ModelMismatch on every rank if any rank's model or settings differ.
    Returns whether any rank passed `failed` (its communication engine stopped after an
    error: then every rank makes a new one, comm.engine_for(renew=True))."""
    me = dist.get_rank(group)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, {**describe(named_params, settings), "failed": failed},
                           group=group)
    ref = everyone[0]
    for other, desc in enumerate(everyone[1:], start=1):
        if desc["params"] != ref["params"]:
            k, a, b = _first_difference(ref["params"], desc["params"])
            if a is not None and b is not None and a[:3] == b[:3]:
                # Buckets are summed element by element in memory order: the same
                # parameter laid out otherwise would be summed with its elements mixed.
                raise ModelMismatch(
                    f"minddp (rank {me}): DDP expects same model across all ranks, but rank "
                    f"{other}'s parameter #{k} '{a[0]}' with strides {b[3]} appears not to "
                    f"match strides of the same param in process 0 ({a[3]}). Give it the same "
                    f"memory format on every rank (e.g. .to(memory_format=torch.channels_last) "
                    f"on all of them or on none).")
            raise ModelMismatch(
                f"minddp (rank {me}): the model differs between ranks 0 and {other}: "
                f"rank 0 has {len(ref['params'])} trainable parameters, rank {other} has "
                f"{len(desc['params'])}; first difference at parameter #{k}: rank 0 has "
                f"{_show(a)}, rank {other} has {_show(b)}. Build the same model on every rank.")
        if desc["settings"] != ref["settings"]:
            diff = [key for key in ref["settings"]
                    if ref["settings"][key] != desc["settings"].get(key)]
            shown = ", ".join(_setting_difference(k, ref["settings"][k],
                                                  desc["settings"].get(k), other) for k in diff)
            raise ModelMismatch(f"minddp (rank {me}): ranks disagree on the wrapper's settings: "
                             f"{shown}. Pass the same arguments on every rank.")
    return any(desc["failed"] for desc in everyone)


def shapes(named, ignored):
    """A settings entry: 'name [shape] dtype' of each tensor not ignored, one of the
    tensors every rank must hold alike (_setting_difference shows the first that differs)."""
    return _Shapes(f"{n} {list(t.shape)} {t.dtype}" for n, t in named if n not in ignored)


class _Shapes(list):
    """What shapes() returns: a list that _setting_difference knows to show in part."""


def _setting_difference(key, first, theirs, other):
    if isinstance(first, _Shapes) or isinstance(theirs, _Shapes):
        first, theirs = first or [], theirs or []  # None: not compared on that rank
        k, a, b = _first_difference(first, theirs)  # as long as the model's: its first difference
        return (f"{key}: rank 0 has {len(first)}, rank {other} has {len(theirs)}; the first "
                f"difference is #{k}: {a or 'none'} on rank 0, {b or 'none'} on rank {other}")
    return f"{key}={first!r} on rank 0 but {theirs!r} on rank {other}"


def broadcast_from_first(tensors, group, cap_bytes=64 * 1024 * 1024, src=0):
    """Overwrite `tensors` on every rank with their values on the group's rank `src` (0).

    Tensors are packed into flat buffers of one dtype and device (up to
    `cap_bytes` each) so a model costs a few broadcasts, not one per tensor.
    """
    if dist.get_world_size(group) == 1:
        return
    batches = {}
    for t in tensors:
        batches.setdefault((t.dtype, t.device), []).append(t)
    for batch in batches.values():
        chunk, size = [], 0
        for t in batch + [None]:
            if t is not None:
                chunk.append(t)
                size += t.numel() * t.element_size()
            if chunk and (t is None or size >= cap_bytes):
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                dist.broadcast(flat, group=group, group_src=src)
                offset = 0
                with torch.no_grad():
                    for c in chunk:
                        c.copy_(flat[offset:offset + c.numel()].view_as(c))
                        offset += c.numel()
                chunk, size = [], 0
