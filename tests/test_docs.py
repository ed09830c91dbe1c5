"""The docs describe what the code does: every config key, and README's example."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from gmlx.config import LOAD_DEFAULTS, Config, LoadSettings, ModelConfig
from gmlx.decisions.types import Decision, DecisionSettings

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


def schema_defaults(model: type[BaseModel], prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= schema_defaults(ann, f"{prefix}{name}.")
        elif not field.is_required():
            out[prefix + name] = field.get_default(call_default_factory=True)
    return out


def documented_defaults(doc: str, section: str | None = None) -> dict[str, str]:
    """key -> its default column, from the `| `key` | default | meaning |` rows
    (of one `## section` when given)."""
    text = (REPO / "docs" / doc).read_text()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", text, re.M))


def literal(cell: str):
    """A default cell's value: `x` is YAML, none is None; anything else (prose
    such as "the canvas") is not a literal."""
    m = re.fullmatch(r"`([^`]*)`", cell.strip())
    if m:
        return yaml.safe_load(m.group(1))
    return None if cell.strip() == "none" else NotImplemented


def test_configuration_defaults_match_the_schema():
    # One source for defaults: the schema (which takes the decision defaults
    # from DecisionSettings); the reference must show the same values.
    expected = (
        schema_defaults(ModelConfig, "models.<id>.")
        | schema_defaults(LoadSettings, "profiles.<name>.")
        | schema_defaults(Config.model_fields["server"].annotation, "server.")
    )
    # A model's load settings default to None in the schema ("not set"), and
    # LOAD_DEFAULTS says what an unset one gets.
    for name, value in LOAD_DEFAULTS.items():
        if expected.get(f"models.<id>.{name}", value) is None:
            expected[f"models.<id>.{name}"] = value
    checked = 0
    for key, cell in documented_defaults("configuration.md").items():
        value = literal(cell)
        if value is NotImplemented or key not in expected or (isinstance(value, str) and value in LOAD_DEFAULTS):
            continue  # prose, or the name of the key it follows (`n_batch`)
        want = expected[key]
        assert value == want, f"docs/configuration.md: {key} documented as {cell}, schema default {want!r}"
        checked += 1
    assert checked >= 40


def test_request_defaults_match_the_code():
    # docs/decisions.md's request table against the Decision defaults parse.py
    # applies; "server.systemone.X (v)" defaults against DecisionSettings.
    fields = {f.name: f.default for f in dataclasses.fields(Decision) if f.default is not dataclasses.MISSING}
    server = DecisionSettings()
    checked = 0
    for key, cell in documented_defaults("decisions.md", "The request").items():
        if key not in fields:
            continue
        m = re.match(r"`server\.systemone\.(\w+)`(?: \((\S+?)[;)])?", cell.strip())
        if m:
            assert fields[key] == getattr(server, m.group(1)), key
            if m.group(2):
                assert yaml.safe_load(m.group(2)) == getattr(server, m.group(1)), key
            checked += 1
            continue
        value = literal(cell)
        if value is not NotImplemented and value is not None:
            assert value == fields[key], f"docs/decisions.md: {key} documented as {cell}, code default {fields[key]!r}"
            checked += 1
    assert checked >= 10
