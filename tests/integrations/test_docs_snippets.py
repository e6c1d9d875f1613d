"""docs/integration.md shows, for each framework, exactly the code the framework tests run.

Before each checked code block the page has ``<!-- snippet: tests/integrations/examples/<file> -->``;
the block must equal that example's regions between ``# --8<-- [start:snippet]`` and
``# --8<-- [end:snippet]`` (each region dedented, regions joined by a blank line). Every example with
such regions is shown on the page.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "integration.md"
EXAMPLES = Path(__file__).parent / "examples"

_SHOWN = re.compile(r"<!-- snippet: (?P<path>\S+) -->\s*\n```python\n(?P<code>.*?)\n```", re.DOTALL)
_REGION = re.compile(
    r"^[ \t]*# --8<-- \[start:snippet\]\n(?P<code>.*?)^[ \t]*# --8<-- \[end:snippet\]\n", re.M | re.S
)


def regions(path: Path) -> str:
    parts = [textwrap.dedent(m["code"]).strip("\n") for m in _REGION.finditer(path.read_text())]
    return "\n\n".join(parts)


def shown() -> dict[str, str]:
    return {m["path"]: m["code"] for m in _SHOWN.finditer(PAGE.read_text())}


def test_every_snippet_on_the_page_is_the_code_the_tests_run():
    blocks = shown()
    assert len(blocks) >= 3, blocks.keys()
    for path, code in blocks.items():
        source = REPO / path
        assert source.is_file(), f"docs/integration.md names {path}, which does not exist"
        assert regions(source), f"{path} has no snippet region"
        assert code == regions(source), f"docs/integration.md's {path} snippet differs from the file"


def test_every_example_with_a_snippet_is_on_the_page():
    with_regions = {f"tests/integrations/examples/{p.name}" for p in EXAMPLES.glob("*.py") if regions(p)}
    assert with_regions == set(shown())
