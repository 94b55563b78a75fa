"""Dumps written by tdinspect's own Recorder (sidecars and all) from ``{key: tensor}`` passes."""

from __future__ import annotations

from tdinspect.dumper.recorder import Recorder


def record_dump(root, passes: list[dict], **recorder_options):
    """``root`` holding one rank's passes, each ``{key: tensor}`` recorded in order (keys may
    name calls: ``"m.attn::call1"``)."""
    rec = Recorder(root, level="module", **recorder_options)
    for entries in passes:
        for key, t in entries.items():
            rec.record(key, t, module_type="Linear")
        rec.step()
    rec.close()
    return root
