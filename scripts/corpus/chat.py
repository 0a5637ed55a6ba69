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
  * ``tools``, ``tool_calls`` and the ``tool`` role follow Qwen3.5's format: the tools listed in the
    system turn, calls as ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>...``,
    results as ``<tool_response>`` blocks in a user turn;
  * ``developer`` messages render as system messages; any other unknown role raises.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- set has_system = messages and messages[0].role in ['system', 'developer'] %}\n"
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {{- \"# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\" }}\n"
    "    {{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}\n"
    "    {%- if has_system and messages[0].content is string and messages[0].content | trim %}\n"
    "        {{- '\\n\\n' + messages[0].content | trim }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- elif has_system %}\n"
    "    {{- '<|im_start|>system\\n' + (messages[0].content if messages[0].content is string else '') + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
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
    "    {%- if message.role in ['system', 'developer'] %}\n"
    "        {%- if not loop.first %}\n"
    "            {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message.role == 'user' %}\n"
    "        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}\n"
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
    "        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if tool_call.function is defined %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {%- if not loop.first %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- elif content | trim %}\n"
    "                    {{- '\\n\\n' }}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "                {%- if tool_call.arguments is mapping %}\n"
    "                    {%- for args_name, args_value in tool_call.arguments | items %}\n"
    "                        {{- '<parameter=' + args_name + '>\\n' }}\n"
    "                        {{- args_value if args_value is string else args_value | tojson }}\n"
    "                        {{- '\\n</parameter>\\n' }}\n"
    "                    {%- endfor %}\n"
    "                {%- endif %}\n"
    "                {{- '</function>\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Unexpected message role '\" + message.role + \"': expected system, developer, user, assistant or tool.\") }}\n"
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

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
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
