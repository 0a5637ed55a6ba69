"""Question/answer chat generators (English and Chinese).

Each item generator returns (question, reasoning, answer).  ``make_chat`` strings
1-3 items into a conversation and renders it through the chat template; the last
assistant turn carries the reasoning (thinking on) or an empty think block
(thinking off).
"""

from __future__ import annotations

from . import chat
from .facts import (
    ANIMALS,
    COLOURS,
    COUNTRIES,
    DAYS_EN,
    DAYS_ZH,
    DEFINITIONS,
    MONTH_DAYS,
    MONTHS_EN,
    MONTHS_ZH,
    OPPOSITES,
    SEASONS,
    UNITS,
)

SYSTEM_EN = ["You are a helpful assistant.", "You are a friendly assistant. Answer clearly and briefly.",
             "You are a patient tutor who explains things simply.", "You are a kind and careful assistant.",
             "Answer the user's questions accurately."]
SYSTEM_ZH = ["你是一个乐于助人的助手。", "你是一个友好的助手，请简洁清楚地回答。", "你是一位耐心的老师，用简单的话解释问题。",
             "请准确地回答用户的问题。", "你是一个细心的助手。"]

ASK_EN = ["", "", "", "Can you tell me: ", "Quick question: ", "I was wondering, ", "Please tell me: ",
          "Hi! ", "Hello, ", "Do you know "]
ASK_ZH = ["", "", "", "请问", "我想知道，", "你好，", "问一下，", "你知道", "考你一下：", "麻烦告诉我，"]


def _q_en(r, core):
    """core: a question sentence ending with '?'."""
    pre = r.choice(ASK_EN)
    if pre == "Do you know ":
        return pre + core[0].lower() + core[1:]
    if pre in ("I was wondering, ",):
        return pre + core[0].lower() + core[1:]
    q = pre + core
    return q.lower() if r.random() < 0.08 else q


def _q_zh(r, core):
    pre = r.choice(ASK_ZH)
    q = pre + core
    if r.random() < 0.3:
        q = q.replace("？", "?")
    return q


# ----------------------------------------------------------------- English items

def en_capital(r):
    c, _, cap, _, cont, _ = r.choice(COUNTRIES)
    q = _q_en(r, r.choice([f"What is the capital of {c}?", f"What's the capital city of {c}?",
                           f"Which city is the capital of {c}?"]))
    think = r.choice([
        f"The user wants the capital of {c}. {c[0].upper() + c[1:]} is a country in {cont}, and its capital city is {cap}.",
        f"{c[0].upper() + c[1:]} is in {cont}. Its capital is {cap}. I will answer with that.",
        f"The question is about {c}. I know that the capital city of {c} is {cap}. So the answer is {cap}.",
    ])
    a = r.choice([f"The capital of {c} is {cap}.", f"{cap} is the capital of {c}.",
                  f"It's {cap}.", f"The capital city of {c} is {cap}, in {cont}."])
    return q, think, a


def en_continent(r):
    c, _, cap, _, cont, _ = r.choice(COUNTRIES)
    q = _q_en(r, r.choice([f"Which continent is {c} in?", f"On which continent is {c}?",
                           f"Is {c} in {cont}?"]))
    think = f"{c[0].upper() + c[1:]}, whose capital is {cap}, is a country in {cont}."
    if q.endswith(f"in {cont}?") or q.endswith(f"in {cont.lower()}?"):
        a = f"Yes, {c} is in {cont}."
    else:
        a = r.choice([f"{c[0].upper() + c[1:]} is in {cont}.", f"It is in {cont}."])
    return q, think, a


def en_colour(r):
    thing, _, col, _ = r.choice(COLOURS)
    q = _q_en(r, r.choice([f"What colour is {thing}?", f"What color is {thing}?",
                           f"What is the colour of {thing}?"]))
    think = r.choice([f"The user asks about the colour of {thing}. It is usually {col}.",
                      f"I picture {thing}. It is {col}."])
    a = r.choice([f"{thing[0].upper() + thing[1:]} is {col}.", f"It is usually {col}.", f"{col.capitalize()}."])
    return q, think, a


def en_animal(r):
    a_ = r.choice(ANIMALS)
    name, _, legs, kind, _, sound, _, home, _, food, _ = a_
    art = "an" if name[0] in "aeiou" else "a"
    kind_q = r.randrange(4)
    if kind_q == 0:
        q = _q_en(r, r.choice([f"How many legs does {art} {name} have?", f"How many legs has {art} {name} got?"]))
        think = f"{art.capitalize()} {name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}. " + (
            f"It has {legs} legs." if legs else "It has no legs at all.")
        a = f"{art.capitalize()} {name} has {legs} legs." if legs else f"{art.capitalize()} {name} has no legs."
    elif kind_q == 1:
        q = _q_en(r, r.choice([f"What sound does {art} {name} make?", f"What noise does {art} {name} make?"]))
        think = f"I think about {art} {name}. It {sound}."
        a = f"{art.capitalize()} {name} {sound}."
    elif kind_q == 2:
        q = _q_en(r, r.choice([f"Where does {art} {name} live?", f"Where do {name}s usually live?"]))
        think = f"{name.capitalize()}s usually live in {home}."
        a = r.choice([f"{name.capitalize()}s usually live in {home}.", f"You can find them in {home}."])
    else:
        q = _q_en(r, r.choice([f"What does {art} {name} eat?", f"What do {name}s eat?"]))
        think = f"The user asks about the food of {art} {name}. {name.capitalize()}s mostly eat {food}."
        a = f"{name.capitalize()}s mostly eat {food}."
    return q, think, a


def en_opposite(r):
    a_, b, _, _ = r.choice(OPPOSITES)
    if r.random() < 0.5:
        a_, b = b, a_
    q = _q_en(r, r.choice([f'What is the opposite of "{a_}"?', f"What's the opposite of {a_}?",
                           f"Give me the opposite of the word {a_}."]))
    think = f'The word is "{a_}". Its opposite is "{b}".'
    a = r.choice([f'The opposite of "{a_}" is "{b}".', f"The opposite of {a_} is {b}.", f"{b.capitalize()}."])
    return q, think, a


def en_day(r):
    i = r.randrange(7)
    k = r.choice([1, 1, 2, 3])
    if r.random() < 0.5:
        j = (i + k) % 7
        q = _q_en(r, f"If today is {DAYS_EN[i]}, what day is it {'tomorrow' if k == 1 else f'in {k} days'}?")
        steps = " -> ".join(DAYS_EN[(i + s) % 7] for s in range(k + 1))
        think = f"Today is {DAYS_EN[i]}. Counting forward {k} day{'s' if k > 1 else ''}: {steps}. So it will be {DAYS_EN[j]}."
        a = f"It will be {DAYS_EN[j]}."
    else:
        j = (i - k) % 7
        q = _q_en(r, f"If today is {DAYS_EN[i]}, what day was it {'yesterday' if k == 1 else f'{k} days ago'}?")
        steps = " -> ".join(DAYS_EN[(i - s) % 7] for s in range(k + 1))
        think = f"Today is {DAYS_EN[i]}. Counting back {k} day{'s' if k > 1 else ''}: {steps}. So it was {DAYS_EN[j]}."
        a = f"It was {DAYS_EN[j]}."
    return q, think, a


def en_month(r):
    m = r.randrange(12)
    t = r.randrange(3)
    if t == 0:
        q = _q_en(r, f"Which month comes after {MONTHS_EN[m]}?")
        think = f"The months go in order. After {MONTHS_EN[m]} comes {MONTHS_EN[(m + 1) % 12]}."
        a = f"{MONTHS_EN[(m + 1) % 12]} comes after {MONTHS_EN[m]}."
    elif t == 1:
        q = _q_en(r, f"How many days are there in {MONTHS_EN[m]}?")
        d = MONTH_DAYS[m]
        think = f"{MONTHS_EN[m]} has {d} days" + (", or 29 in a leap year." if m == 1 else ".")
        a = f"{MONTHS_EN[m]} has {d} days" + (" (29 in a leap year)." if m == 1 else ".")
    else:
        season = next(s for s in SEASONS if m in s[2])
        q = _q_en(r, f"In the northern half of the world, which season is {MONTHS_EN[m]} in?")
        think = f"In the northern hemisphere, {season[0]} covers " + ", ".join(MONTHS_EN[x] for x in season[2]) + \
            f". {MONTHS_EN[m]} is one of them."
        a = f"{MONTHS_EN[m]} is in {season[0]} in the northern hemisphere."
    return q, think, a


def en_count(r):
    t = r.randrange(4)
    if t == 0:
        a_ = r.randint(1, 30)
        b = a_ + r.randint(3, 9)
        q = _q_en(r, f"Count from {a_} to {b}.".rstrip(".") + r.choice([".", ", please.", "."]))
        nums = ", ".join(str(x) for x in range(a_, b + 1))
        think = f"I start at {a_} and add one each time until I reach {b}."
        a = nums + "."
    elif t == 1:
        n = r.randint(1, 999)
        q = _q_en(r, f"What number comes after {n}?")
        think = f"The number after {n} is {n} + 1 = {n + 1}."
        a = f"{n + 1} comes after {n}."
    elif t == 2:
        x, y = r.sample(range(1, 1000), 2)
        q = _q_en(r, f"Which is bigger, {x} or {y}?")
        big, small = max(x, y), min(x, y)
        think = f"Compare {x} and {y}. {big} is greater than {small} because {big} - {small} = {big - small}, which is positive."
        a = f"{big} is bigger than {small}."
    else:
        word = r.choice(["apple", "river", "garden", "elephant", "window", "yellow", "banana", "music",
                         "teacher", "bridge", "orange", "pencil", "morning", "rabbit", "library", "summer",
                         "mountain", "chocolate", "butterfly", "kitchen", "computer", "island", "friend"])
        q = _q_en(r, f'How many letters are in the word "{word}"?')
        think = "Spell it out: " + ", ".join(f"{c} ({i + 1})" for i, c in enumerate(word)) + \
            f". That is {len(word)} letters."
        a = f'The word "{word}" has {len(word)} letters.'
    return q, think, a


def en_define(r):
    w, d, _, _ = r.choice(DEFINITIONS)
    q = _q_en(r, r.choice([f"What is {w}?", f"Can you explain what {w} is?", f"Define {w}."]))
    think = r.choice([f"The user wants a simple definition of {w}. {w.capitalize()} is {d}.",
                      f"I should explain {w} in plain words: {d}."])
    a = r.choice([f"{w.capitalize()} is {d}.", f"Simply put, {w} is {d}."])
    return q, think, a


def en_unit(r):
    what, v, _, _ = r.choice(UNITS)
    q = _q_en(r, f"How many {what} are there?" if r.random() < 0.5 else f"How many {what}?")
    think = f"This is a standard fact: there are {v} {what}."
    a = r.choice([f"There are {v} {what}.", f"{v}."])
    return q, think, a


EN_ITEMS = [(en_capital, 3), (en_continent, 1), (en_colour, 2), (en_animal, 3), (en_opposite, 2),
            (en_day, 2), (en_month, 2), (en_count, 3), (en_define, 2), (en_unit, 1)]


# ----------------------------------------------------------------- Chinese items

def zh_capital(r):
    _, c, _, cap, _, cont = r.choice(COUNTRIES)
    q = _q_zh(r, r.choice([f"{c}的首都是哪里？", f"{c}的首都是什么？", f"哪个城市是{c}的首都？"]))
    think = r.choice([f"用户问的是{c}的首都。{c}是{cont}的一个国家，它的首都是{cap}。",
                      f"{c}位于{cont}，首都是{cap}。所以答案是{cap}。"])
    a = r.choice([f"{c}的首都是{cap}。", f"是{cap}。", f"{cap}是{c}的首都。"])
    return q, think, a


def zh_continent(r):
    _, c, _, cap, _, cont = r.choice(COUNTRIES)
    q = _q_zh(r, r.choice([f"{c}在哪个大洲？", f"{c}位于哪个洲？"]))
    think = f"{c}的首都是{cap}，这个国家在{cont}。"
    a = r.choice([f"{c}在{cont}。", f"{c}位于{cont}。"])
    return q, think, a


def zh_colour(r):
    _, thing, _, col = r.choice(COLOURS)
    q = _q_zh(r, r.choice([f"{thing}是什么颜色的？", f"{thing}通常是什么颜色？"]))
    think = r.choice([f"用户问{thing}的颜色。{thing}一般是{col}的。", f"我想一想{thing}的样子，它是{col}的。"])
    a = r.choice([f"{thing}是{col}的。", f"通常是{col}。"])
    return q, think, a


def zh_animal(r):
    name_en, name, legs, _, kind, _, sound, _, home, _, food = r.choice(ANIMALS)
    t = r.randrange(4)
    if t == 0:
        q = _q_zh(r, f"{name}有几条腿？")
        think = f"{name}是{kind}。" + (f"它有{legs}条腿。" if legs else "它没有腿。")
        a = f"{name}有{legs}条腿。" if legs else f"{name}没有腿。"
    elif t == 1:
        q = _q_zh(r, r.choice([f"{name}怎么叫？", f"{name}会发出什么声音？"]))
        think = f"想一想{name}的叫声：{name}{sound}。"
        a = f"{name}{sound}。"
    elif t == 2:
        q = _q_zh(r, f"{name}住在哪里？")
        think = f"{name}通常生活在{home}。"
        a = r.choice([f"{name}通常生活在{home}。", f"它们一般住在{home}。"])
    else:
        q = _q_zh(r, r.choice([f"{name}吃什么？", f"{name}平时吃什么东西？"]))
        think = f"用户问{name}的食物。{name}主要吃{food}。"
        a = f"{name}主要吃{food}。"
    return q, think, a


def zh_opposite(r):
    _, _, a_, b = r.choice(OPPOSITES)
    if r.random() < 0.5:
        a_, b = b, a_
    q = _q_zh(r, r.choice([f"“{a_}”的反义词是什么？", f"{a_}的反义词是什么？"]))
    think = f"“{a_}”的意思相反的词是“{b}”。"
    a = r.choice([f"“{a_}”的反义词是“{b}”。", f"是“{b}”。"])
    return q, think, a


def zh_day(r):
    i = r.randrange(7)
    k = r.choice([1, 1, 2, 3])
    if r.random() < 0.5:
        j = (i + k) % 7
        when = "明天" if k == 1 else f"{k}天后"
        q = _q_zh(r, f"如果今天是{DAYS_ZH[i]}，那么{when}是星期几？")
        steps = "→".join(DAYS_ZH[(i + s) % 7] for s in range(k + 1))
        think = f"今天是{DAYS_ZH[i]}，往后数{k}天：{steps}。所以是{DAYS_ZH[j]}。"
        a = f"{when}是{DAYS_ZH[j]}。"
    else:
        j = (i - k) % 7
        when = "昨天" if k == 1 else f"{k}天前"
        q = _q_zh(r, f"如果今天是{DAYS_ZH[i]}，那么{when}是星期几？")
        steps = "→".join(DAYS_ZH[(i - s) % 7] for s in range(k + 1))
        think = f"今天是{DAYS_ZH[i]}，往前数{k}天：{steps}。所以是{DAYS_ZH[j]}。"
        a = f"{when}是{DAYS_ZH[j]}。"
    return q, think, a


def zh_month(r):
    m = r.randrange(12)
    if r.random() < 0.5:
        q = _q_zh(r, f"{MONTHS_ZH[m]}的下一个月是几月？")
        think = f"月份按顺序排列，{MONTHS_ZH[m]}之后是{MONTHS_ZH[(m + 1) % 12]}。"
        a = f"是{MONTHS_ZH[(m + 1) % 12]}。"
    else:
        d = MONTH_DAYS[m]
        q = _q_zh(r, f"{MONTHS_ZH[m]}有多少天？")
        think = f"{MONTHS_ZH[m]}有{d}天" + ("，闰年的时候有29天。" if m == 1 else "。")
        a = f"{MONTHS_ZH[m]}有{d}天" + ("（闰年有29天）。" if m == 1 else "。")
    return q, think, a


def zh_count(r):
    t = r.randrange(3)
    if t == 0:
        a_ = r.randint(1, 30)
        b = a_ + r.randint(3, 9)
        q = _q_zh(r, f"请从{a_}数到{b}。")
        think = f"从{a_}开始，每次加一，一直数到{b}。"
        a = "、".join(str(x) for x in range(a_, b + 1)) + "。"
    elif t == 1:
        n = r.randint(1, 999)
        q = _q_zh(r, f"{n}后面的数是多少？")
        think = f"{n}加1等于{n + 1}。"
        a = f"{n}后面是{n + 1}。"
    else:
        x, y = r.sample(range(1, 1000), 2)
        big, small = max(x, y), min(x, y)
        q = _q_zh(r, f"{x}和{y}哪个大？")
        think = f"比较{x}和{y}：{big}减{small}等于{big - small}，是正数，所以{big}更大。"
        a = f"{big}比{small}大。"
    return q, think, a


def zh_define(r):
    _, _, w, d = r.choice(DEFINITIONS)
    q = _q_zh(r, r.choice([f"什么是{w}？", f"{w}是什么意思？", f"请解释一下什么是{w}。"]))
    think = r.choice([f"用户想知道{w}的意思。我用简单的话来解释：{w}是{d}。", f"{w}就是{d}。"])
    a = r.choice([f"{w}是{d}。", f"简单地说，{w}就是{d}。"])
    return q, think, a


def zh_unit(r):
    _, v, qz, unit = r.choice(UNITS)
    q = _q_zh(r, qz + "？")
    think = f"这是一个常识：{qz.replace('多少', str(v)).replace('几', str(v))}。"
    a = f"{v}{unit}。"
    return q, think, a


ZH_ITEMS = [(zh_capital, 3), (zh_continent, 1), (zh_colour, 2), (zh_animal, 3), (zh_opposite, 2),
            (zh_day, 2), (zh_month, 2), (zh_count, 2), (zh_define, 2), (zh_unit, 1)]


def pick(r, items):
    fns = [f for f, w in items for _ in range(w)]
    return r.choice(fns)(r)


def make_chat(r, lang, extra_items=None, p_think=0.6):
    """One rendered conversation of 1-3 items; extra_items: [(fn, weight)] mixed in."""
    items = (EN_ITEMS if lang == "en" else ZH_ITEMS) + (extra_items or [])
    n = r.choices([1, 2, 3], weights=[6, 3, 1])[0]
    turns, think = [], None
    for _ in range(n):
        q, th, a = pick(r, items)
        turns.append((q, a))
        think = th
    system = None
    if r.random() < 0.3:
        system = r.choice(SYSTEM_EN if lang == "en" else SYSTEM_ZH)
    return chat.conversation(turns, system=system, think=think if r.random() < p_think else None)
