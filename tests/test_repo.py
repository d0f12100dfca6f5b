"""The README's two commands stay true: CI runs exactly the README's test command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    main_cmd, test_cmd = blocks
    assert "lmengine generate --prompt-file examples/prompts.txt" in main_cmd
    assert "pytest" in test_cmd
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines
    assert readme.index(main_cmd) < readme.index("## ")  # both open the README
