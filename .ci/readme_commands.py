"""The README's set-up commands, one per line: every command line of the first ```bash block
under "## Set-up" (comments and blank lines left out), for .ci/run to run as written.

$ python .ci/readme_commands.py README.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def setup_commands(readme: str) -> list[str]:
    """The command lines of the Set-up section's first bash block."""
    section = re.search(r"^## Set-up\n(.*?)(?=^## )", readme, re.S | re.M)
    block = section and re.search(r"^```bash\n(.*?)^```", section[1], re.S | re.M)
    if not block:
        raise SystemExit("readme_commands: no ```bash block under '## Set-up' in the README")
    lines = (line.strip() for line in block[1].splitlines())
    return [line for line in lines if line and not line.startswith("#")]


if __name__ == "__main__":
    print("\n".join(setup_commands(Path(sys.argv[1]).read_text())))
