"""Chat templates: the config's, else the GGUF's, else a built-in for the architecture.

Rendered with a sandboxed Jinja environment the way Hugging Face templates
expect. A template that has no system role (it raises, or drops the text)
gets the system text folded into the first user message instead: nothing the
caller wrote is silently lost.
"""

from __future__ import annotations

import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..decisions.literal import literal

# Gemma's turn format. Gemma has no system role: system text goes ahead of the
# first user message, as Google's own template does.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

BUILTIN = {"gemma": GEMMA, "chatml": CHATML}

# Architectures whose GGUFs may lack a template, and the format they were trained on.
ARCH_BUILTIN = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen3moe": "chatml",
}

_PROBE = "\u2063gmlx-system-probe\u2063"


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.origin = origin  # "config", "gguf" or "builtin:<name>"
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _env().from_string(source)
        self.has_system_role = self._probe_system()
        # Qwen3-style templates honour enable_thinking and open a <think> block.
        self.has_thinking = "enable_thinking" in source and "<think>" in source

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    def _probe_system(self) -> bool:
        try:
            out = self._render([{"role": "system", "content": _PROBE}, {"role": "user", "content": "u"}], True, {})
        except Exception:
            return False
        return _PROBE in out

    def render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None
    ) -> str:
        msgs = [dict(m) for m in messages]
        if msgs and msgs[0]["role"] == "system" and not self.has_system_role:
            system = msgs.pop(0)["content"]
            if msgs and msgs[0]["role"] == "user":
                msgs[0]["content"] = system + "\n\n" + msgs[0]["content"]
            else:
                msgs.insert(0, {"role": "user", "content": system})
        # Message contents are the caller's text: tokenized as plain text, so a
        # "<end_of_turn>" inside a state stays text (decisions/literal.py).
        for m in msgs:
            m["content"] = literal(m["content"])
        return self._render(msgs, add_generation_prompt, dict(kwargs or {}))


def choose_template(
    configured: str | None, from_gguf: str | None, arch: str, bos_token: str, eos_token: str
) -> ChatTemplate | None:
    """Config `chat_template` (Jinja text or a built-in name) > GGUF > built-in for the arch."""
    if configured:
        if configured in BUILTIN:
            return ChatTemplate(BUILTIN[configured], f"builtin:{configured}", bos_token, eos_token)
        return ChatTemplate(configured, "config", bos_token, eos_token)
    if from_gguf:
        return ChatTemplate(from_gguf, "gguf", bos_token, eos_token)
    name = ARCH_BUILTIN.get(arch)
    if name:
        return ChatTemplate(BUILTIN[name], f"builtin:{name}", bos_token, eos_token)
    return None
