"""Small bilingual knowledge tables used by the generators (English, Chinese)."""

# country, 国家, capital, 首都, continent, 大洲
COUNTRIES = [
    ("France", "法国", "Paris", "巴黎", "Europe", "欧洲"),
    ("Germany", "德国", "Berlin", "柏林", "Europe", "欧洲"),
    ("Italy", "意大利", "Rome", "罗马", "Europe", "欧洲"),
    ("Spain", "西班牙", "Madrid", "马德里", "Europe", "欧洲"),
    ("Portugal", "葡萄牙", "Lisbon", "里斯本", "Europe", "欧洲"),
    ("the United Kingdom", "英国", "London", "伦敦", "Europe", "欧洲"),
    ("Ireland", "爱尔兰", "Dublin", "都柏林", "Europe", "欧洲"),
    ("Greece", "希腊", "Athens", "雅典", "Europe", "欧洲"),
    ("Norway", "挪威", "Oslo", "奥斯陆", "Europe", "欧洲"),
    ("Sweden", "瑞典", "Stockholm", "斯德哥尔摩", "Europe", "欧洲"),
    ("Finland", "芬兰", "Helsinki", "赫尔辛基", "Europe", "欧洲"),
    ("Denmark", "丹麦", "Copenhagen", "哥本哈根", "Europe", "欧洲"),
    ("Poland", "波兰", "Warsaw", "华沙", "Europe", "欧洲"),
    ("Austria", "奥地利", "Vienna", "维也纳", "Europe", "欧洲"),
    ("the Netherlands", "荷兰", "Amsterdam", "阿姆斯特丹", "Europe", "欧洲"),
    ("Russia", "俄罗斯", "Moscow", "莫斯科", "Europe", "欧洲"),
    ("Egypt", "埃及", "Cairo", "开罗", "Africa", "非洲"),
    ("Kenya", "肯尼亚", "Nairobi", "内罗毕", "Africa", "非洲"),
    ("Nigeria", "尼日利亚", "Abuja", "阿布贾", "Africa", "非洲"),
    ("Ethiopia", "埃塞俄比亚", "Addis Ababa", "亚的斯亚贝巴", "Africa", "非洲"),
    ("Morocco", "摩洛哥", "Rabat", "拉巴特", "Africa", "非洲"),
    ("China", "中国", "Beijing", "北京", "Asia", "亚洲"),
    ("Japan", "日本", "Tokyo", "东京", "Asia", "亚洲"),
    ("South Korea", "韩国", "Seoul", "首尔", "Asia", "亚洲"),
    ("India", "印度", "New Delhi", "新德里", "Asia", "亚洲"),
    ("Thailand", "泰国", "Bangkok", "曼谷", "Asia", "亚洲"),
    ("Vietnam", "越南", "Hanoi", "河内", "Asia", "亚洲"),
    ("Indonesia", "印度尼西亚", "Jakarta", "雅加达", "Asia", "亚洲"),
    ("the Philippines", "菲律宾", "Manila", "马尼拉", "Asia", "亚洲"),
    ("Mongolia", "蒙古", "Ulaanbaatar", "乌兰巴托", "Asia", "亚洲"),
    ("Turkey", "土耳其", "Ankara", "安卡拉", "Asia", "亚洲"),
    ("Iran", "伊朗", "Tehran", "德黑兰", "Asia", "亚洲"),
    ("Canada", "加拿大", "Ottawa", "渥太华", "North America", "北美洲"),
    ("the United States", "美国", "Washington, D.C.", "华盛顿", "North America", "北美洲"),
    ("Mexico", "墨西哥", "Mexico City", "墨西哥城", "North America", "北美洲"),
    ("Cuba", "古巴", "Havana", "哈瓦那", "North America", "北美洲"),
    ("Brazil", "巴西", "Brasília", "巴西利亚", "South America", "南美洲"),
    ("Argentina", "阿根廷", "Buenos Aires", "布宜诺斯艾利斯", "South America", "南美洲"),
    ("Chile", "智利", "Santiago", "圣地亚哥", "South America", "南美洲"),
    ("Peru", "秘鲁", "Lima", "利马", "South America", "南美洲"),
    ("Colombia", "哥伦比亚", "Bogotá", "波哥大", "South America", "南美洲"),
    ("Australia", "澳大利亚", "Canberra", "堪培拉", "Oceania", "大洋洲"),
    ("New Zealand", "新西兰", "Wellington", "惠灵顿", "Oceania", "大洋洲"),
]

# thing, 东西, colour, 颜色
COLOURS = [
    ("the sky on a clear day", "晴天的天空", "blue", "蓝色"), ("grass", "草", "green", "绿色"),
    ("snow", "雪", "white", "白色"), ("a ripe banana", "熟香蕉", "yellow", "黄色"),
    ("coal", "煤", "black", "黑色"), ("a ripe tomato", "熟西红柿", "red", "红色"),
    ("a carrot", "胡萝卜", "orange", "橙色"), ("milk", "牛奶", "white", "白色"),
    ("a lemon", "柠檬", "yellow", "黄色"), ("a fresh leaf in summer", "夏天的新叶", "green", "绿色"),
    ("a strawberry", "草莓", "red", "红色"), ("the sea", "大海", "blue", "蓝色"),
    ("a crow", "乌鸦", "black", "黑色"), ("an eggplant", "茄子", "purple", "紫色"),
    ("chocolate", "巧克力", "brown", "棕色"), ("a polar bear's fur", "北极熊的毛", "white", "白色"),
    ("a fire truck", "消防车", "red", "红色"), ("a frog", "青蛙", "green", "绿色"),
    ("the yolk of an egg", "蛋黄", "yellow", "黄色"), ("a pumpkin", "南瓜", "orange", "橙色"),
    ("tree bark", "树皮", "brown", "棕色"), ("a cloud on a sunny day", "晴天的白云", "white", "白色"),
    ("grapes used for raisins", "紫葡萄", "purple", "紫色"), ("the night sky", "夜空", "dark blue or black", "深蓝色或黑色"),
]

# animal, 动物, legs, kind, 类别, sound, 叫声, home, 住处, food, 食物
ANIMALS = [
    ("cat", "猫", 4, "mammal", "哺乳动物", "meows", "喵喵叫", "houses", "家里", "fish and meat", "鱼和肉"),
    ("dog", "狗", 4, "mammal", "哺乳动物", "barks", "汪汪叫", "houses", "家里", "meat", "肉"),
    ("cow", "牛", 4, "mammal", "哺乳动物", "moos", "哞哞叫", "farms", "农场", "grass", "草"),
    ("sheep", "羊", 4, "mammal", "哺乳动物", "bleats", "咩咩叫", "farms", "农场", "grass", "草"),
    ("horse", "马", 4, "mammal", "哺乳动物", "neighs", "嘶鸣", "farms and fields", "农场和草地", "grass and hay", "草和干草"),
    ("pig", "猪", 4, "mammal", "哺乳动物", "oinks", "哼哼叫", "farms", "农场", "almost anything", "几乎什么都吃"),
    ("duck", "鸭子", 2, "bird", "鸟类", "quacks", "嘎嘎叫", "ponds", "池塘", "plants and small bugs", "水草和小虫"),
    ("chicken", "鸡", 2, "bird", "鸟类", "clucks", "咯咯叫", "farms", "农场", "grain", "谷物"),
    ("owl", "猫头鹰", 2, "bird", "鸟类", "hoots", "咕咕叫", "forests", "森林", "mice", "老鼠"),
    ("eagle", "老鹰", 2, "bird", "鸟类", "screeches", "尖叫", "mountains", "山里", "small animals and fish", "小动物和鱼"),
    ("penguin", "企鹅", 2, "bird", "鸟类", "squawks", "嘎嘎叫", "icy coasts", "冰冷的海岸", "fish", "鱼"),
    ("lion", "狮子", 4, "mammal", "哺乳动物", "roars", "吼叫", "grasslands", "草原", "meat", "肉"),
    ("tiger", "老虎", 4, "mammal", "哺乳动物", "roars", "吼叫", "forests", "森林", "meat", "肉"),
    ("elephant", "大象", 4, "mammal", "哺乳动物", "trumpets", "长鸣", "grasslands and forests", "草原和森林", "plants", "植物"),
    ("panda", "熊猫", 4, "mammal", "哺乳动物", "bleats softly", "轻声叫", "bamboo forests", "竹林", "bamboo", "竹子"),
    ("monkey", "猴子", 4, "mammal", "哺乳动物", "chatters", "吱吱叫", "forests", "森林", "fruit", "水果"),
    ("rabbit", "兔子", 4, "mammal", "哺乳动物", "is mostly quiet", "很少出声", "fields", "田野", "carrots and grass", "胡萝卜和草"),
    ("mouse", "老鼠", 4, "mammal", "哺乳动物", "squeaks", "吱吱叫", "fields and houses", "田野和房子里", "seeds", "种子"),
    ("frog", "青蛙", 4, "amphibian", "两栖动物", "croaks", "呱呱叫", "ponds", "池塘", "insects", "昆虫"),
    ("snake", "蛇", 0, "reptile", "爬行动物", "hisses", "发出嘶嘶声", "grass and rocks", "草丛和石头间", "mice and eggs", "老鼠和蛋"),
    ("spider", "蜘蛛", 8, "arachnid", "蛛形动物", "is silent", "不出声", "webs", "网上", "insects", "昆虫"),
    ("bee", "蜜蜂", 6, "insect", "昆虫", "buzzes", "嗡嗡叫", "hives", "蜂巢", "nectar", "花蜜"),
    ("ant", "蚂蚁", 6, "insect", "昆虫", "is silent", "不出声", "nests under the ground", "地下的巢穴", "seeds and crumbs", "种子和碎屑"),
    ("butterfly", "蝴蝶", 6, "insect", "昆虫", "is silent", "不出声", "gardens", "花园", "nectar", "花蜜"),
    ("fish", "鱼", 0, "fish", "鱼类", "is silent", "不出声", "rivers, lakes and seas", "河流、湖泊和大海", "small plants and animals", "小植物和小动物"),
    ("whale", "鲸鱼", 0, "mammal", "哺乳动物", "sings", "唱歌", "the ocean", "海洋", "krill and fish", "磷虾和鱼"),
    ("octopus", "章鱼", 8, "mollusc", "软体动物", "is silent", "不出声", "the sea", "大海", "crabs", "螃蟹"),
    ("camel", "骆驼", 4, "mammal", "哺乳动物", "grunts", "低吼", "deserts", "沙漠", "dry plants", "干草和灌木"),
    ("kangaroo", "袋鼠", 2, "mammal", "哺乳动物", "clicks", "咔咔叫", "Australian grasslands", "澳大利亚的草原", "grass", "草"),
    ("goose", "鹅", 2, "bird", "鸟类", "honks", "嘎嘎叫", "lakes and farms", "湖边和农场", "grass and grain", "草和谷物"),
]

OPPOSITES = [
    ("hot", "cold", "热", "冷"), ("big", "small", "大", "小"), ("tall", "short", "高", "矮"),
    ("fast", "slow", "快", "慢"), ("happy", "sad", "高兴", "难过"), ("light", "dark", "明亮", "黑暗"),
    ("up", "down", "上", "下"), ("open", "closed", "开", "关"), ("early", "late", "早", "晚"),
    ("full", "empty", "满", "空"), ("old", "new", "旧", "新"), ("long", "short", "长", "短"),
    ("heavy", "light", "重", "轻"), ("wet", "dry", "湿", "干"), ("clean", "dirty", "干净", "脏"),
    ("strong", "weak", "强", "弱"), ("near", "far", "近", "远"), ("rich", "poor", "富", "穷"),
    ("day", "night", "白天", "夜晚"), ("left", "right", "左", "右"), ("inside", "outside", "里面", "外面"),
    ("push", "pull", "推", "拉"), ("buy", "sell", "买", "卖"), ("win", "lose", "赢", "输"),
    ("begin", "end", "开始", "结束"), ("love", "hate", "爱", "恨"), ("true", "false", "真", "假"),
    ("easy", "hard", "容易", "困难"), ("quiet", "loud", "安静", "吵闹"), ("thick", "thin", "厚", "薄"),
    ("sweet", "bitter", "甜", "苦"), ("young", "old", "年轻", "年老"), ("first", "last", "第一", "最后"),
    ("give", "take", "给", "拿"), ("front", "back", "前", "后"), ("high", "low", "高", "低"),
]

DAYS_EN = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
DAYS_ZH = ["星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日"]
MONTHS_EN = ["January", "February", "March", "April", "May", "June", "July", "August",
             "September", "October", "November", "December"]
MONTHS_ZH = ["一月", "二月", "三月", "四月", "五月", "六月", "七月", "八月", "九月", "十月",
             "十一月", "十二月"]
MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
SEASONS = [("spring", "春天", [2, 3, 4]), ("summer", "夏天", [5, 6, 7]),
           ("autumn", "秋天", [8, 9, 10]), ("winter", "冬天", [11, 0, 1])]

# word, definition, 词, 定义
DEFINITIONS = [
    ("a river", "a long natural stream of water that flows across the land into a lake or the sea",
     "河流", "在陆地上流动、最后流进湖泊或大海的天然水道"),
    ("a mountain", "a very high hill with steep sides", "山", "地面上高高隆起、坡很陡的部分"),
    ("a library", "a building where people can read and borrow books", "图书馆", "人们可以看书和借书的地方"),
    ("a doctor", "a person whose job is to help sick people get better", "医生", "帮助病人恢复健康的人"),
    ("a teacher", "a person who helps others learn", "老师", "教别人知识、帮助别人学习的人"),
    ("a farmer", "a person who grows crops or raises animals", "农民", "种庄稼或养动物的人"),
    ("a bridge", "a structure that lets people cross over a river or a road", "桥", "让人们跨过河流或道路的建筑"),
    ("a clock", "a machine that shows what time it is", "钟", "用来显示时间的机器"),
    ("rain", "water that falls from clouds in drops", "雨", "从云里落下来的水滴"),
    ("a forest", "a large area covered with many trees", "森林", "长满许多树木的大片土地"),
    ("an island", "a piece of land with water all around it", "岛", "四面都是水的陆地"),
    ("a desert", "a dry place with very little rain and few plants", "沙漠", "雨很少、植物很少的干燥地方"),
    ("a friend", "a person you know well and like to spend time with", "朋友", "你熟悉并且喜欢在一起的人"),
    ("a map", "a drawing that shows where places are", "地图", "画出各个地方位置的图"),
    ("a seed", "the small part of a plant that can grow into a new plant", "种子", "植物中能长成新植物的小部分"),
    ("ice", "water that has frozen and become hard", "冰", "水冻住以后变成的硬块"),
    ("a market", "a place where people buy and sell things", "市场", "人们买卖东西的地方"),
    ("a kitchen", "the room where food is cooked", "厨房", "做饭的房间"),
    ("a boat", "a small vehicle that travels on water", "船", "在水上行驶的交通工具"),
    ("a garden", "a piece of land where flowers or vegetables are grown", "花园", "种花或种菜的地方"),
    ("a week", "a period of seven days", "星期", "七天的时间"),
    ("a rainbow", "an arc of colours in the sky, seen when sunlight shines through rain",
     "彩虹", "阳光照过雨滴时天空中出现的彩色弧线"),
    ("a poem", "a piece of writing with rhythm, often arranged in short lines", "诗", "有节奏、常常分成短行来写的文字"),
    ("a computer", "a machine that stores information and follows instructions to work with it",
     "电脑", "能存储信息并按照指令处理信息的机器"),
    ("a moon", "a natural object that travels around a planet", "月亮", "绕着行星转的天然天体"),
    ("a volcano", "a mountain that can throw out hot melted rock", "火山", "会喷出炽热岩浆的山"),
    ("a nest", "a home that a bird builds for its eggs", "鸟窝", "鸟为了放蛋而搭的家"),
    ("a museum", "a building where old or interesting objects are shown to visitors",
     "博物馆", "展出古老或有趣物品给参观者看的地方"),
    ("a recipe", "a set of instructions for cooking a dish", "食谱", "做一道菜的步骤说明"),
    ("an umbrella", "a folding cover that keeps the rain off you", "雨伞", "可以折叠、用来挡雨的东西"),
]

# unit facts: question part, value, zh question part
UNITS = [
    ("minutes in an hour", 60, "一小时有多少分钟", "分钟"), ("seconds in a minute", 60, "一分钟有多少秒", "秒"),
    ("hours in a day", 24, "一天有多少小时", "小时"), ("days in a week", 7, "一个星期有多少天", "天"),
    ("months in a year", 12, "一年有多少个月", "个月"), ("centimetres in a metre", 100, "一米有多少厘米", "厘米"),
    ("grams in a kilogram", 1000, "一千克有多少克", "克"), ("metres in a kilometre", 1000, "一千米有多少米", "米"),
    ("days in a normal year", 365, "平年一年有多少天", "天"), ("years in a century", 100, "一个世纪有多少年", "年"),
    ("sides of a triangle", 3, "三角形有几条边", "条边"), ("sides of a square", 4, "正方形有几条边", "条边"),
    ("sides of a hexagon", 6, "六边形有几条边", "条边"), ("legs of a spider", 8, "蜘蛛有几条腿", "条腿"),
    ("continents on Earth", 7, "地球上有几个大洲", "个大洲"), ("colours in a rainbow", 7, "彩虹有几种颜色", "种颜色"),
    ("players on a football team on the field", 11, "一支足球队在场上有几名球员", "名球员"),
    ("planets in the solar system", 8, "太阳系有几颗行星", "颗行星"),
]

NUM_ZH = "零一二三四五六七八九十"


def zh_num(n: int) -> str:
    """Chinese numerals for 0..9999 (used in some story text)."""
    if n < 0:
        return "负" + zh_num(-n)
    if n <= 10:
        return NUM_ZH[n]
    if n < 20:
        return "十" + (NUM_ZH[n % 10] if n % 10 else "")
    if n < 100:
        return NUM_ZH[n // 10] + "十" + (NUM_ZH[n % 10] if n % 10 else "")
    if n < 1000:
        r = n % 100
        s = NUM_ZH[n // 100] + "百"
        if r == 0:
            return s
        return s + ("零" + NUM_ZH[r] if r < 10 else (("一" + zh_num(r)) if r < 20 else zh_num(r)))
    r = n % 1000
    s = NUM_ZH[n // 1000] + "千"
    if r == 0:
        return s
    return s + ("零" + zh_num(r) if r < 100 else zh_num(r))
