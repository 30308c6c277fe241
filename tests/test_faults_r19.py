"""Bad input and faults, round 19: the four classes round 18 left, and those a new probe found. Each test failed on
the code before its fix; docs/cli.md, "Faults handled (round 19)", lists them."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import invoke
from tests.test_errors import check


# ----------------------------------------------------------------------------- a file's kind in remat show


def test_show_names_a_profile_it_cannot_read_a_profile_file(profile_path: Path, tmp_path: Path):
    """Rule 6 of NOTE [ Files that are not remat's JSON ]: `remat show` called a truncated profile a "plan file",
    to be re-created with `remat plan ...`."""
    cut = tmp_path / "cut.json"
    cut.write_text(profile_path.read_text()[:200])
    result = invoke("show", cut)
    check(result, 2, f"error: profile file {cut} is not valid JSON (line ", "it may be truncated: re-create it with "
                                                                           "`remat profile ...`")
    result = invoke("show", tmp_path)
    check(result, 2, f"error: {tmp_path} is a directory, not a plan or profile file")
    cut.write_bytes(b"\x1f\x8b\x08")
    check(invoke("show", cut), 2, f"error: plan or profile file {cut} is not UTF-8 text (it looks like a gzip file); "
                                  "pass the JSON file `remat plan` or `remat profile` wrote (uncompressed)")
