import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_api_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "accuracy" in capsys.readouterr().out


def test_readme_quick_start_names_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
