"""Every torch workaround's premise holds on the installed torch (functrain.compiler.workarounds),
each check fails loudly naming its workaround when the premise goes, and docs/compiler.md's table
lists exactly these workarounds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.distributed.device_mesh import DeviceMesh

from functrain.compiler import workarounds

DOC = Path(__file__).resolve().parent.parent / "docs" / "compiler.md"


@pytest.mark.parametrize("name", [w.name for w in workarounds.WORKAROUNDS])
def test_each_workarounds_premise_holds_on_this_torch(name):
    workarounds.by_name(name).check()


def test_a_check_names_its_workaround_when_the_premise_is_gone(monkeypatch):
    def getstate(self):
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    monkeypatch.setattr(DeviceMesh, "__getstate__", getstate)
    with pytest.raises(workarounds.PremiseChanged, match="'mesh_hash_in_cache_key'.*DeviceMesh pickles without _hash"):
        workarounds.by_name("mesh_hash_in_cache_key").check()
    with pytest.raises(KeyError, match="no torch workaround named 'nope'"):
        workarounds.by_name("nope")


def test_the_docs_table_is_the_list():
    rows = re.findall(r"^\| `(\w+)` \|", DOC.read_text(), flags=re.M)
    assert rows == [w.name for w in workarounds.WORKAROUNDS]
