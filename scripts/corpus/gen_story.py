"""Templated short stories in English and Chinese.

A story = opening (time, place, hero) + one of several plots (each sentence drawn
from alternatives, slots filled with characters, objects, places, feelings) +
an ending with an optional moral.  ``story_chat_*`` wraps a story as a chat answer
to "tell me a story about ...", with a short planning note as the reasoning.
"""

from __future__ import annotations

from . import chat

# name, description (en) ; name, description (zh)
HEROES_EN = [("Mimi", "a little cat"), ("Pip", "a small mouse"), ("Anna", "a curious girl"),
             ("Tom", "a young boy"), ("Mr. Brown", "an old farmer"), ("Daisy", "a brown cow"),
             ("Leo", "a brave lion cub"), ("Rosa", "a clever fox"), ("Ben", "a shy rabbit"),
             ("Lucy", "a kind teacher"), ("Oliver", "a little owl"), ("Grandma Li", "a cheerful grandmother"),
             ("Sam", "a busy baker"), ("Nina", "a young painter"), ("Kiko", "a playful puppy"),
             ("Max", "a small robot"), ("Ella", "a little duck"), ("Jack", "a fisherman's son")]
HEROES_ZH = [("咪咪", "一只小猫"), ("豆豆", "一只小老鼠"), ("小兰", "一个爱问问题的女孩"), ("小虎", "一个小男孩"),
             ("王爷爷", "一位老农民"), ("花花", "一头小花牛"), ("壮壮", "一只勇敢的小狮子"), ("阿狸", "一只聪明的狐狸"),
             ("白白", "一只害羞的兔子"), ("李老师", "一位温和的老师"), ("咕咕", "一只小猫头鹰"), ("张奶奶", "一位快乐的奶奶"),
             ("阿福", "一个面包师"), ("小雨", "一个爱画画的姑娘"), ("旺旺", "一只调皮的小狗"), ("小铁", "一个小机器人"),
             ("嘎嘎", "一只小鸭子"), ("小海", "一个渔夫的儿子")]
PLACES_EN = ["the park", "the forest", "a small village", "the seaside", "the garden", "the school",
             "the market", "the mountain", "the river bank", "the library", "a quiet farm", "the old town",
             "the zoo", "the lake", "a busy city"]
PLACES_ZH = ["公园", "森林", "小村子", "海边", "花园", "学校", "集市", "山上", "河边", "图书馆", "农场", "老街",
             "动物园", "湖边", "大城市"]
OBJECTS_EN = ["a red ball", "an old key", "a kite", "a map", "a blue hat", "a basket of apples", "a lantern",
              "a picture book", "a shiny shell", "an umbrella", "a wooden box", "a little bell", "a paper boat",
              "a jar of honey", "a pair of boots"]
OBJECTS_ZH = ["一个红皮球", "一把旧钥匙", "一只风筝", "一张地图", "一顶蓝帽子", "一篮苹果", "一盏灯笼", "一本图画书",
              "一个亮晶晶的贝壳", "一把雨伞", "一个木盒子", "一个小铃铛", "一只纸船", "一罐蜂蜜", "一双靴子"]
TIMES_EN = ["One sunny morning", "On a rainy afternoon", "One cold winter evening", "Early one spring day",
            "Late one summer night", "One windy autumn day", "Once upon a time", "Long ago",
            "One quiet Sunday", "On the first day of the holidays"]
TIMES_ZH = ["一个晴朗的早晨", "一个下雨的下午", "一个寒冷的冬夜", "春天的一个早上", "夏天的一个夜晚",
            "秋天刮风的一天", "从前", "很久很久以前", "一个安静的星期天", "放假的第一天"]
FEEL_EN = [("happy", "sad"), ("excited", "worried"), ("proud", "nervous"), ("calm", "scared"),
           ("glad", "upset")]
FEEL_ZH = [("高兴", "难过"), ("兴奋", "着急"), ("自豪", "紧张"), ("平静", "害怕"), ("开心", "失落")]
MORALS_EN = ["Good friends help each other.", "Patience brings its own reward.",
             "It is better to share than to keep everything for yourself.",
             "Being brave does not mean you are never afraid.", "Small kindnesses make a big difference.",
             "Practice makes things easier.", "Listening carefully can solve many problems.",
             "Home is wherever your friends are."]
MORALS_ZH = ["好朋友要互相帮助。", "耐心会带来回报。", "分享比独占更快乐。", "勇敢不是不害怕，而是害怕了也不放弃。",
             "小小的善意也能带来很大的温暖。", "多练习，事情就会变得容易。", "认真倾听能解决很多问题。",
             "有朋友的地方就是家。"]


def _c(r, *opts):
    return r.choice(opts)


def story_en(r, hero=None, obj=None):
    name, desc = hero or r.choice(HEROES_EN)
    friend, fdesc = r.choice([h for h in HEROES_EN if h[0] != name])
    place, place2 = r.sample(PLACES_EN, 2)
    obj = obj or r.choice(OBJECTS_EN)
    good, bad = r.choice(FEEL_EN)
    time = r.choice(TIMES_EN)
    s = [_c(r, f"{time}, {name}, {desc}, went to {place}.",
            f"{time}, there was {desc} called {name} who lived near {place}.",
            f"{time}, {desc} named {name} woke up early and walked to {place}.")]
    plot = r.randrange(6)
    if plot == 0:  # lost and found
        s += [_c(r, f"{name} always carried {obj}.", f"{name} had {obj} that {name} loved very much."),
              _c(r, f"But on the way, {name} dropped it and did not notice.", f"But when {name} looked down, it was gone!"),
              f"{name} felt {bad}.",
              _c(r, f"{name} looked under the bushes, behind the trees and near {place2}.",
                 f"{name} searched everywhere, from {place} all the way to {place2}."),
              _c(r, f"Then {friend}, {fdesc}, came along and asked what was wrong.", f"Soon {friend}, {fdesc}, saw {name} and offered to help."),
              _c(r, "Together they followed the path back, step by step.", "They walked slowly and looked carefully."),
              _c(r, f"At last {friend} shouted, \"I found it!\"", "Finally, they found it lying in the grass."),
              f"{name} was so {good} and thanked {friend} again and again."]
    elif plot == 1:  # learning a skill
        skill = r.choice(["ride a bicycle", "swim", "bake bread", "fly a kite", "read a big book", "play the drum",
                          "climb a tree", "paint a picture"])
        s += [f"{name} wanted to learn to {skill}.",
              _c(r, "The first time, it went badly.", "At first it was much harder than it looked."),
              f"{name} felt {bad} and almost gave up.",
              _c(r, f"But {friend}, {fdesc}, said, \"Try again tomorrow. Everyone starts somewhere.\"",
                 f"{friend}, {fdesc}, smiled and said, \"Let's practise together.\""),
              _c(r, f"So {name} practised every day for a week.", f"Day after day, {name} tried again."),
              _c(r, "Little by little, it became easier.", "Each day was a bit better than the one before."),
              f"On the last day, {name} could {skill} all alone, and felt very {good}."]
    elif plot == 2:  # a storm
        s += [_c(r, "Suddenly dark clouds covered the sky.", "Then the wind began to blow very hard."),
              _c(r, "Big drops of rain started to fall.", "Thunder rolled over the hills."),
              f"{name} felt {bad} and looked for a place to hide.",
              _c(r, f"{friend}, {fdesc}, waved from a little house near {place2}.",
                 f"Just then {name} saw a light. It was {friend}, {fdesc}, holding {obj}."),
              f"\"Come inside!\" called {friend}.",
              _c(r, "They sat together, drank warm tea and told stories.", "They waited together and counted the flashes of lightning."),
              _c(r, "When the storm was over, a rainbow shone across the sky.", "By evening the sky was clear and full of stars."),
              f"{name} felt {good} to have such a good friend."]
    elif plot == 3:  # sharing
        n = r.randint(3, 9)
        s += [_c(r, f"{name} found {n} sweet apples under a tree.", f"{name} had baked {n} small cakes."),
              f"{name} wanted to keep them all.",
              _c(r, f"Then {name} saw {friend}, {fdesc}, who looked hungry.", f"But {friend}, {fdesc}, had nothing to eat that day."),
              _c(r, f"{name} thought for a moment.", f"{name} stopped and thought about it."),
              f"Then {name} gave half of them to {friend}.",
              _c(r, f"{friend} smiled and shared {obj} in return.", f"{friend} was very {good} and invited {name} to play."),
              f"That day, {name} learned that sharing made the food taste even better."]
    elif plot == 4:  # a trip
        s += [_c(r, f"{name} and {friend} decided to visit {place2}.", f"{name} asked {friend}, {fdesc}, to come and see {place2}."),
              _c(r, f"They packed {obj} and some bread.", f"{name} took {obj}, just in case."),
              _c(r, "The road was long and the sun was hot.", "They crossed a bridge and climbed a small hill."),
              _c(r, "On the way they met an old turtle who told them a shortcut.", f"Halfway there, {friend} got tired, so they rested under a tree."),
              _c(r, f"When they arrived, {place2} was even more beautiful than {name} had imagined.",
                 f"At {place2}, they saw birds, flowers and a little waterfall."),
              f"They stayed until sunset and then went home, tired but {good}."]
    else:  # a surprise
        s += [_c(r, f"It was {friend}'s birthday, but {friend} thought everyone had forgotten.",
                 f"{friend}, {fdesc}, had been {bad} all week."),
              f"{name} had an idea.",
              _c(r, f"{name} asked all the neighbours to come to {place2}.", f"{name} made a card and wrapped {obj} as a present."),
              _c(r, "They hung paper lanterns and made a big cake.", "Everyone helped: some sang, some cooked, and some decorated."),
              f"When {friend} arrived, everyone shouted, \"Surprise!\"",
              f"{friend} was so {good} that tears of joy came.",
              _c(r, "They laughed and played until the moon rose.", "It was the best day of the whole year.")]
    end = _c(r, "The end.", f"From then on, {name} and {friend} were the best of friends.",
             f"{name} never forgot that day.", "")
    if end:
        s.append(end)
    text = " ".join(s)
    if r.random() < 0.5:  # split into paragraphs
        k = len(s) // 2
        text = " ".join(s[:k]) + "\n\n" + " ".join(s[k:])
    if r.random() < 0.4:
        text += "\n\n" + _c(r, "Moral: ", "The lesson: ", "") + r.choice(MORALS_EN)
    if r.random() < 0.3:
        title = _c(r, f"{name} and {obj.split(' ', 1)[1].title()}", f"{name}'s Day", f"A Story about {name}",
                   f"{name} and {friend}")
        text = f"{title}\n\n{text}"
    return text, name, desc


def story_zh(r, hero=None, obj=None):
    name, desc = hero or r.choice(HEROES_ZH)
    friend, fdesc = r.choice([h for h in HEROES_ZH if h[0] != name])
    place, place2 = r.sample(PLACES_ZH, 2)
    obj = obj or r.choice(OBJECTS_ZH)
    good, bad = r.choice(FEEL_ZH)
    time = r.choice(TIMES_ZH)
    s = [_c(r, f"{time}，{desc}{name}来到了{place}。", f"{time}，{desc}{name}住在{place}。",
            f"{time}，{name}早早起床，走到了{place}。")]
    plot = r.randrange(6)
    if plot == 0:
        s += [_c(r, f"{name}总是随身带着{obj}。", f"{name}有{obj}，非常喜欢它。"),
              _c(r, f"可是在路上，{name}不小心把它弄丢了。", "可是低头一看，东西不见了！"),
              f"{name}心里很{bad}。",
              _c(r, f"{name}在草丛里找，在树后面找，一直找到{place2}。", f"{name}从{place}一路找到{place2}，到处都找遍了。"),
              _c(r, f"这时，{fdesc}{friend}走过来，问{name}怎么了。", f"不久，{friend}看见了{name}，说要帮忙。"),
              _c(r, "他们一起沿着原路慢慢往回走。", "他们一边走一边仔细地看。"),
              _c(r, f"最后，{friend}大声喊道：“找到了！”", "终于，他们在草地上找到了它。"),
              f"{name}{good}极了，一遍又一遍地感谢{friend}。"]
    elif plot == 1:
        skill = r.choice(["骑自行车", "游泳", "烤面包", "放风筝", "读一本厚厚的书", "打鼓", "爬树", "画画"])
        s += [f"{name}想学{skill}。",
              _c(r, "第一次试的时候，一点也不顺利。", "刚开始，这比想象中难多了。"),
              f"{name}觉得很{bad}，差点就放弃了。",
              _c(r, f"可是{friend}说：“明天再试试吧，谁都是从头学起的。”", f"{friend}笑着说：“我们一起练习吧。”"),
              _c(r, f"于是{name}每天都练习。", f"一天又一天，{name}不停地尝试。"),
              _c(r, "慢慢地，事情变得容易了。", "每天都比前一天进步一点点。"),
              f"到了最后一天，{name}已经能自己{skill}了，心里特别{good}。"]
    elif plot == 2:
        s += [_c(r, "突然，乌云遮住了天空。", "这时，风越刮越大。"),
              _c(r, "大颗大颗的雨点落了下来。", "远处传来了隆隆的雷声。"),
              f"{name}有点{bad}，赶紧找地方躲雨。",
              _c(r, f"{friend}在{place2}旁边的小屋里向{name}招手。", f"就在这时，{name}看见了一点亮光，原来是{friend}提着灯笼来了。"),
              f"“快进来！”{friend}喊道。",
              _c(r, "他们坐在一起，喝着热茶，讲着故事。", "他们一起等待，数着天上的闪电。"),
              _c(r, "暴风雨过去以后，天上出现了一道彩虹。", "到了晚上，天晴了，满天都是星星。"),
              f"{name}觉得有这样的好朋友真{good}。"]
    elif plot == 3:
        n = r.randint(3, 9)
        s += [_c(r, f"{name}在树下捡到了{n}个甜甜的苹果。", f"{name}烤了{n}块小蛋糕。"),
              f"{name}本来想全部留给自己。",
              _c(r, f"这时，{name}看见了{friend}，{friend}看起来很饿。", f"可是{friend}那天什么也没吃。"),
              _c(r, f"{name}想了一会儿。", f"{name}停下来想了想。"),
              f"然后，{name}把一半分给了{friend}。",
              _c(r, f"{friend}笑了，也把{obj}拿出来和{name}一起玩。", f"{friend}非常{good}，请{name}一起去玩。"),
              f"那天，{name}明白了：分享以后，东西会变得更好吃。"]
    elif plot == 4:
        s += [_c(r, f"{name}和{friend}决定去{place2}看看。", f"{name}从来没有去过{place2}，就约{friend}一起去看一看。"),
              _c(r, f"他们带上了{obj}和一些面包。", f"{name}带上了{obj}，以防万一。"),
              _c(r, "路很长，太阳也很晒。", "他们过了一座小桥，又爬上了一座小山。"),
              _c(r, "路上，他们遇到一只老乌龟，老乌龟告诉他们一条近路。", f"走到一半，{friend}累了，他们就在大树下休息。"),
              _c(r, f"到了以后，{place2}比{name}想象的还要美。", f"在{place2}，他们看到了小鸟、鲜花和一条小瀑布。"),
              f"他们一直玩到太阳下山才回家，虽然很累，但是很{good}。"]
    else:
        s += [_c(r, f"那天是{friend}的生日，可是{friend}以为大家都忘了。", f"{friend}这一个星期都很{bad}。"),
              f"{name}想到了一个好主意。",
              _c(r, f"{name}请邻居们都到{place2}来。", f"{name}做了一张贺卡，还把{obj}包成了礼物。"),
              _c(r, "大家挂起纸灯笼，做了一个大蛋糕。", "大家都来帮忙：有的唱歌，有的做饭，有的布置房间。"),
              f"{friend}一到，大家就喊：“生日快乐！”",
              f"{friend}{good}得流下了眼泪。",
              _c(r, "他们又说又笑，一直玩到月亮升起来。", "这是一年里最快乐的一天。")]
    end = _c(r, "", f"从那以后，{name}和{friend}成了最好的朋友。", f"{name}永远也忘不了那一天。")
    if end:
        s.append(end)
    text = "".join(s)
    if r.random() < 0.5:
        k = len(s) // 2
        text = "".join(s[:k]) + "\n\n" + "".join(s[k:])
    if r.random() < 0.4:
        text += "\n\n" + _c(r, "这个故事告诉我们：", "道理：", "") + r.choice(MORALS_ZH)
    if r.random() < 0.3:
        title = _c(r, f"{name}的一天", f"{name}和{friend}", f"{name}的故事")
        text = f"《{title}》\n\n{text}"
    return text, name, desc


def story_chat_en(r):
    name, desc = r.choice(HEROES_EN)
    q = r.choice([f"Tell me a short story about {desc}.", f"Can you write a little story about {desc} named {name}?",
                  f"Please tell a bedtime story about {desc}.", f"Write a short story for children about {desc}."])
    text, _, _ = story_en(r, hero=(name, desc))
    think = r.choice([f"The user wants a short story about {desc}. I will call the hero {name}, give the story a simple problem, "
                      "let a friend help, and end happily.",
                      f"A short children's story about {desc}. Plan: introduce {name}, add a problem, solve it with kindness, "
                      "and finish with a gentle ending."])
    return q, think, text


def story_chat_zh(r):
    name, desc = r.choice(HEROES_ZH)
    q = r.choice([f"给我讲一个关于{desc[2:]}的小故事。", f"请写一个关于{desc}{name}的短故事。", f"讲一个睡前故事吧，主角是{desc[2:]}。",
                  f"能给小朋友写个短故事吗？主角是{desc}。"])
    text, _, _ = story_zh(r, hero=(name, desc))
    think = r.choice([f"用户想听一个关于{desc[2:]}的故事。主角就叫{name}，先遇到一个小困难，再由朋友帮忙解决，最后有一个温暖的结局。",
                      f"写一个短小的儿童故事。计划：介绍{name}，出现一个问题，用善意解决问题，结尾简单温馨。"])
    return q, think, text


def chat_wrap(r, fn, p_think=0.6):
    q, think, text = fn(r)
    return chat.conversation([(q, text)], think=think if r.random() < p_think else None)
