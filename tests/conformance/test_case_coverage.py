"""Every case in the shared conformance file has its test here (one ``test_cNN_*`` per case id)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = REPO.parent / "shared" / "conformance" / "cases.jsonl"


@pytest.mark.skipif(not CASES.is_file(), reason="../shared/conformance/cases.jsonl is not beside this checkout")
def test_every_shared_case_has_a_test():
    ids = {json.loads(line)["id"].lower() for line in CASES.read_text().splitlines() if line.strip()}
    source = (Path(__file__).parent / "test_cases.py").read_text()
    tested = set(re.findall(r"^def test_(c\d+)_", source, flags=re.M))
    assert ids, "no cases read"
    assert ids <= tested, f"cases without a test: {sorted(ids - tested)}"
