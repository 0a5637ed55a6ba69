"""The demo model's chat template (Qwen3 / Qwen3.5 style) and a jinja2 renderer.

This module is the single source of truth: build_corpus.py renders every chat
training sample through CHAT_TEMPLATE, and train_tokenizer.py stores the same
string as ``chat_template`` in deltaserve/assets/demo/tokenizer_config.json.

Behaviour:
  * every message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
  * assistant turns before the last user turn lose any ``<think>...</think>``;
  * an assistant turn after the last user turn is rendered as
    ``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` (reasoning from
    ``reasoning_content`` or from a ``<think>`` block inside ``content``;
    a final assistant turn without reasoning gets an empty think block);
  * ``add_generation_prompt`` appends ``<|im_start|>assistant\\n<think>\\n``
    (thinking on, the default) or, with ``enable_thinking=False``,
    ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``;
  * the ``tool`` role and ``tools`` / ``tool_calls`` follow Qwen3's format.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or reasoning_content %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

_TEMPLATE = None


def _compiled():
    global _TEMPLATE
    if _TEMPLATE is None:
        import json

        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        _TEMPLATE = env.from_string(CHAT_TEMPLATE)
    return _TEMPLATE


def render(messages, add_generation_prompt=False, tools=None, **kwargs) -> str:
    """Render like transformers' apply_chat_template(tokenize=False)."""
    return _compiled().render(messages=messages, tools=tools,
                              add_generation_prompt=add_generation_prompt, **kwargs)


def conversation(turns, system=None, think=None):
    """turns: list of (user, answer); think: reasoning for the last answer (None = thinking off).

    Returns the rendered training string (ends with ``<|im_end|>\\n``)."""
    msgs = []
    if system:
        msgs.append({"role": "system", "content": system})
    for i, (q, a) in enumerate(turns):
        msgs.append({"role": "user", "content": q})
        m = {"role": "assistant", "content": a}
        if i == len(turns) - 1 and think:
            m["reasoning_content"] = think
        msgs.append(m)
    return render(msgs)
