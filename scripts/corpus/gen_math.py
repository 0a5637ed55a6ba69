"""Arithmetic sums and word problems with step-by-step reasoning (English and Chinese).

Each item returns (question, reasoning, answer); gen_qa.make_chat renders them.
"""

from __future__ import annotations

NAMES_EN = ["Tom", "Anna", "Lily", "Sam", "Ben", "Mia", "Jack", "Emma", "Leo", "Grace", "Noah", "Ruby",
            "Oscar", "Chloe", "Max", "Ella", "Henry", "Zoe", "Lucas", "Ivy"]
NAMES_ZH = ["小明", "小红", "小刚", "小丽", "小华", "小芳", "小军", "小梅", "小强", "小雪", "王叔叔", "李阿姨",
            "张老师", "妈妈", "爸爸", "奶奶", "小兰", "小杰", "小玉", "小东"]
# object (plural en), 量词+物品 zh, unit price range
OBJECTS = [("apples", "个苹果"), ("pencils", "支铅笔"), ("stickers", "张贴纸"), ("marbles", "颗弹珠"),
           ("books", "本书"), ("cookies", "块饼干"), ("balloons", "个气球"), ("eggs", "个鸡蛋"),
           ("flowers", "朵花"), ("cards", "张卡片"), ("oranges", "个橙子"), ("candies", "颗糖"),
           ("shells", "个贝壳"), ("toy cars", "辆玩具车"), ("stamps", "张邮票")]
CONTAINERS = [("boxes", "个盒子", "盒"), ("bags", "个袋子", "袋"), ("baskets", "个篮子", "篮"),
              ("rows", "排", "排"), ("plates", "个盘子", "盘")]


def _add_steps_en(a, b):
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}."
    ta, oa, tb, ob = a - a % 10, a % 10, b - b % 10, b % 10
    return (f"Split into tens and ones: {ta} + {tb} = {ta + tb}, and {oa} + {ob} = {oa + ob}. "
            f"Then {ta + tb} + {oa + ob} = {a + b}.")


def _add_steps_zh(a, b):
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}。"
    ta, oa, tb, ob = a - a % 10, a % 10, b - b % 10, b % 10
    return f"把数拆成整十和个位：{ta} + {tb} = {ta + tb}，{oa} + {ob} = {oa + ob}，再把它们加起来：{ta + tb} + {oa + ob} = {a + b}。"


def _sub_steps_en(a, b):
    if b < 10:
        return f"{a} - {b} = {a - b}."
    tb, ob = b - b % 10, b % 10
    return f"First take away {tb}: {a} - {tb} = {a - tb}. Then take away {ob}: {a - tb} - {ob} = {a - b}."


def _sub_steps_zh(a, b):
    if b < 10:
        return f"{a} - {b} = {a - b}。"
    tb, ob = b - b % 10, b % 10
    return f"先减去{tb}：{a} - {tb} = {a - tb}；再减去{ob}：{a - tb} - {ob} = {a - b}。"


def _mul_steps_en(a, b):
    if a < 10 or a % 10 == 0 or (b > 10 and a > 10):
        return f"{a} × {b} = {a * b}."
    ta, oa = a - a % 10, a % 10
    return f"Break {a} into {ta} and {oa}: {ta} × {b} = {ta * b}, {oa} × {b} = {oa * b}, and {ta * b} + {oa * b} = {a * b}."


def _mul_steps_zh(a, b):
    if a < 10 or a % 10 == 0 or (b > 10 and a > 10):
        return f"{a} × {b} = {a * b}。"
    ta, oa = a - a % 10, a % 10
    return f"把{a}拆成{ta}和{oa}：{ta} × {b} = {ta * b}，{oa} × {b} = {oa * b}，合起来是{ta * b} + {oa * b} = {a * b}。"


def en_sum(r):
    op = r.choice("+-×÷")
    if op == "+":
        a, b = r.randint(2, 99), r.randint(2, 99)
        steps, res = _add_steps_en(a, b), a + b
    elif op == "-":
        a = r.randint(10, 150)
        b = r.randint(1, a)
        steps, res = _sub_steps_en(a, b), a - b
    elif op == "×":
        a, b = r.randint(2, 25), r.randint(2, 9)
        steps, res = _mul_steps_en(a, b), a * b
    else:
        b, res = r.randint(2, 9), r.randint(2, 20)
        a = b * res
        steps = f"I need a number that gives {a} when multiplied by {b}. {b} × {res} = {a}, so {a} ÷ {b} = {res}."
    sym = {"×": r.choice(["×", "*", "times"]), "÷": r.choice(["÷", "/", "divided by"])}.get(op, op)
    if sym in ("+", "-") and r.random() < 0.3:
        sym = {"+": "plus", "-": "minus"}[op]
    q = r.choice([f"What is {a} {sym} {b}?", f"Calculate {a} {sym} {b}.", f"{a} {sym} {b} = ?",
                  f"Can you work out {a} {sym} {b}?", f"What's {a} {sym} {b}?"])
    a_ = r.choice([f"{a} {op} {b} = {res}.", f"The answer is {res}.", f"{res}"])
    return q, steps, a_


def zh_sum(r):
    op = r.choice("+-×÷")
    if op == "+":
        a, b = r.randint(2, 99), r.randint(2, 99)
        steps, res = _add_steps_zh(a, b), a + b
        w = "加"
    elif op == "-":
        a = r.randint(10, 150)
        b = r.randint(1, a)
        steps, res = _sub_steps_zh(a, b), a - b
        w = "减"
    elif op == "×":
        a, b = r.randint(2, 25), r.randint(2, 9)
        steps, res = _mul_steps_zh(a, b), a * b
        w = "乘以"
    else:
        b, res = r.randint(2, 9), r.randint(2, 20)
        a = b * res
        steps = f"要找一个数，乘以{b}等于{a}。因为{b} × {res} = {a}，所以{a} ÷ {b} = {res}。"
        w = "除以"
    expr = f"{a} {op} {b}" if r.random() < 0.6 else f"{a}{w}{b}"
    q = r.choice([f"{expr}等于多少？", f"请计算{expr}。", f"{expr} = ?", f"帮我算一下{expr}。", f"{expr}是多少？"])
    a_ = r.choice([f"{a} {op} {b} = {res}。", f"答案是{res}。", f"等于{res}。"])
    return q, steps, a_


def en_word(r):
    n = r.choice(NAMES_EN)
    obj, _ = r.choice(OBJECTS)
    t = r.randrange(6)
    if t == 0:
        a, b = r.randint(2, 40), r.randint(2, 30)
        q = f"{n} has {a} {obj}. A friend gives {n} {b} more. How many {obj} does {n} have now?"
        th = f"{n} starts with {a} {obj} and gets {b} more, so I add. " + _add_steps_en(a, b)
        res = a + b
        ans = f"{n} has {res} {obj} now."
    elif t == 1:
        a = r.randint(10, 60)
        b = r.randint(1, a - 1)
        q = f"{n} had {a} {obj} and gave away {b}. How many {obj} are left?"
        th = f"{n} had {a} and gave away {b}, so I subtract. " + _sub_steps_en(a, b)
        res = a - b
        ans = f"{n} has {res} {obj} left."
    elif t == 2:
        c, _, _ = r.choice(CONTAINERS)
        a, b = r.randint(2, 9), r.randint(2, 12)
        q = f"There are {a} {c} with {b} {obj} in each. How many {obj} are there in total?"
        th = f"There are {a} groups of {b}, so I multiply: " + _mul_steps_en(b, a)
        res = a * b
        ans = f"There are {res} {obj} in total."
    elif t == 3:
        k, each = r.randint(2, 8), r.randint(2, 9)
        tot = k * each
        q = f"{n} shares {tot} {obj} equally among {k} friends. How many {obj} does each friend get?"
        th = f"Sharing equally means dividing: {tot} ÷ {k}. Since {k} × {each} = {tot}, each friend gets {each}."
        res = each
        ans = f"Each friend gets {each} {obj}."
    elif t == 4:
        a, b, c = r.randint(10, 40), r.randint(2, 20), r.randint(1, 9)
        q = f"{n} has {a} {obj}, buys {b} more, and then loses {c}. How many {obj} does {n} have?"
        th = (f"Step 1: {a} + {b} = {a + b} after buying. "
              f"Step 2: {a + b} - {c} = {a + b - c} after losing {c}.")
        res = a + b - c
        ans = f"{n} has {res} {obj}."
    else:
        price, k = r.randint(2, 15), r.randint(2, 9)
        paid = ((price * k) // 10 + 1) * 10 + r.choice([0, 10, 20])
        q = f"One notebook costs {price} dollars. {n} buys {k} notebooks and pays with {paid} dollars. How much change does {n} get?"
        th = (f"First the cost: {k} × {price} = {k * price} dollars. "
              f"Then the change: {paid} - {k * price} = {paid - k * price} dollars.")
        res = paid - k * price
        ans = f"{n} gets {res} dollars in change."
    if r.random() < 0.3:
        ans = f"The answer is {res}. " + ans
    return q, th, ans


def zh_word(r):
    n = r.choice(NAMES_ZH)
    _, obj = r.choice(OBJECTS)
    unit, thing = obj[0], obj[1:]  # measure word, noun
    t = r.randrange(6)
    if t == 0:
        a, b = r.randint(2, 40), r.randint(2, 30)
        q = f"{n}有{a}{unit}{thing}，朋友又送给{n}{b}{unit}。{n}现在一共有多少{unit}{thing}？"
        th = f"{n}原来有{a}{unit}，又得到{b}{unit}，所以用加法。" + _add_steps_zh(a, b)
        res = a + b
        ans = f"{n}现在一共有{res}{unit}{thing}。"
    elif t == 1:
        a = r.randint(10, 60)
        b = r.randint(1, a - 1)
        q = f"{n}有{a}{unit}{thing}，送给别人{b}{unit}，还剩多少{unit}？"
        th = f"原来有{a}{unit}，送出{b}{unit}，用减法。" + _sub_steps_zh(a, b)
        res = a - b
        ans = f"还剩{res}{unit}{thing}。"
    elif t == 2:
        _, c, cu = r.choice(CONTAINERS)
        a, b = r.randint(2, 9), r.randint(2, 12)
        q = f"有{a}{c}，每{cu}有{b}{unit}{thing}。一共有多少{unit}{thing}？"
        th = f"{a}组，每组{b}{unit}，用乘法：" + _mul_steps_zh(b, a)
        res = a * b
        ans = f"一共有{res}{unit}{thing}。"
    elif t == 3:
        k, each = r.randint(2, 8), r.randint(2, 9)
        tot = k * each
        q = f"{n}把{tot}{unit}{thing}平均分给{k}个小朋友，每人分到几{unit}？"
        th = f"平均分用除法：{tot} ÷ {k}。因为{k} × {each} = {tot}，所以每人分到{each}{unit}。"
        res = each
        ans = f"每人分到{each}{unit}{thing}。"
    elif t == 4:
        a, b, c = r.randint(10, 40), r.randint(2, 20), r.randint(1, 9)
        q = f"{n}有{a}{unit}{thing}，又买了{b}{unit}，后来丢了{c}{unit}。{n}现在有多少{unit}？"
        th = f"第一步：买了以后是{a} + {b} = {a + b}{unit}。第二步：丢了{c}{unit}，{a + b} - {c} = {a + b - c}。"
        res = a + b - c
        ans = f"{n}现在有{res}{unit}{thing}。"
    else:
        price, k = r.randint(2, 15), r.randint(2, 9)
        paid = ((price * k) // 10 + 1) * 10 + r.choice([0, 10, 20])
        q = f"一个笔记本{price}元，{n}买了{k}个，付了{paid}元，应该找回多少钱？"
        th = f"先算总价：{k} × {price} = {k * price}元。再算找零：{paid} - {k * price} = {paid - k * price}元。"
        res = paid - k * price
        ans = f"应该找回{res}元。"
    if r.random() < 0.3:
        ans = f"答案是{res}。" + ans
    return q, th, ans


EN_MATH = [(en_sum, 1), (en_word, 2)]
ZH_MATH = [(zh_sum, 1), (zh_word, 2)]
