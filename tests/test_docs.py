"""The docs describe what the code does: every config key, and README's example."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from gmlx.config import Config, LoadSettings, ModelConfig

REPO = Path(__file__).resolve().parent.parent


def schema_keys(model: type[BaseModel], prefix: str) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= schema_keys(ann, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_configuration_reference_matches_schema():
    documented = set(re.findall(r"^\| `([^`]+)` \|", (REPO / "docs" / "configuration.md").read_text(), re.M))
    expected = (
        schema_keys(ModelConfig, "models.<id>.")
        | schema_keys(LoadSettings, "profiles.<name>.")
        | {"aliases.<name>"}
        | schema_keys(Config.model_fields["server"].annotation, "server.")
    )
    assert schema_keys(Config, "") >= {"models", "aliases", "profiles"}
    assert documented - expected == set(), "documented but not in the schema"
    assert expected - documented == set(), "in the schema but not documented"


def test_readme_starts_with_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert "gmlx serve --config decisions.yaml" in blocks[0] and '.[embedded]' in blocks[0]
    assert "python -m pytest" in blocks[1] and '.[test]' in blocks[1]
    # Nothing but the title comes before them.
    assert text.index("```bash") < text.index("\n", text.index("# gmlx")) + 3
