"""Regenerate pyproject.toml's [tool.flwr.app.config] and docs/CONFIG.md from the schema.

    .venv/bin/python scripts/sync_config.py
"""

from pathlib import Path

from experiments.cli.keys import config_markdown
from tasks.config import defaults, to_toml

ROOT = Path(__file__).resolve().parents[1]
pyproject = ROOT / "pyproject.toml"
text = pyproject.read_text()
head, rest = text.split("[tool.flwr.app.config]\n", 1)
tail = rest[rest.index("\n[tool.pytest.ini_options]"):]
pyproject.write_text(head + "[tool.flwr.app.config]\n" + to_toml(defaults()) + tail)
(ROOT / "docs" / "CONFIG.md").write_text(config_markdown())
print("pyproject.toml and docs/CONFIG.md regenerated")
