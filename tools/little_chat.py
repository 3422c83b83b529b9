"""little_chat.py - the seeded synthetic parts of the little K3's training data (used by train_little_k3.py).

Chat conversations in K3's chat format, rendered segment by segment by the trainer's ChatRenderer (the
layout of chapters/15_generate.hpp and docs/kimi-k3.md section 4: every message closes with
`<|close|>message<|sep|><|end_of_msg|>`, an assistant body is `<|open|>response<|sep|>TEXT<|close|>
response<|sep|>`, optionally preceded by a think block and followed by a tools block), of these kinds:

  passage     an instruction over a passage (a corpus paragraph or a short generated story): quote a
              sentence of it (the first, the last, the one that mentions X), name who did what, answer a
              question whose answer is in it, count its sentences, continue a list given in it
  smalltalk   greetings, thanks, how are you, who are you, goodbye; several wordings, several replies
  refusal     questions it cannot know the answer to (today's date or weather with no tool, the user's
              own name or plans, tomorrow's prices, a private number): it says so, in varied words
  tool        a tool-declare system message (1-3 tools of TOOLS, the JSON keys sorted), a user request
              whose arguments are in the user's words, the assistant's call (arguments copied from them),
              the tool message with a result, and an answer that uses the result; sometimes a question
              the declared tools do not serve, answered without a call
  continue    the old kind: a corpus sentence, the text that follows it

and copy passages (plain text) that reward attention that copies: a paragraph shown, other text, the
same paragraph again; lists of random words said two to four times; key-value lists read back.

Everything is drawn from a random.Random the caller seeds; the names, places and objects are lists
here, the passages come from the caller's documents (training documents for training, held-out ones
for the evaluation prompts, which therefore share no passage with training).
"""

import json

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal",
         "Lena", "Marco", "Nadia", "Omar", "Paula", "Quentin", "Rosa", "Sami", "Tara", "Umar", "Vera",
         "Walter", "Yara", "Zoe", "Mr. Hale", "Mrs. Ortiz", "Dr. Chen", "the old farmer", "the teacher",
         "the captain", "the baker", "her brother", "my aunt", "the mayor", "a young nurse"]
PLACES = ["in the garden", "at the station", "by the river", "in the kitchen", "at the market",
          "on the roof", "in the library", "near the bridge", "at the harbour", "in the attic",
          "behind the school", "on the hill", "at the post office", "in the forest", "on the train"]
ACTIONS = [("found", ["a key", "an old letter", "a silver coin", "a lost dog", "a map", "a red umbrella"]),
           ("painted", ["the fence", "a small boat", "the front door", "a picture of the sea"]),
           ("repaired", ["the clock", "a bicycle", "the radio", "the broken window", "an old chair"]),
           ("baked", ["a loaf of bread", "an apple pie", "twelve cookies", "a birthday cake"]),
           ("wrote", ["a poem", "a long letter", "a report", "a song about the rain"]),
           ("sold", ["three chairs", "the old car", "a basket of plums", "two paintings"]),
           ("planted", ["a row of beans", "an oak tree", "tulips", "tomatoes"]),
           ("carried", ["a heavy box", "the groceries", "a ladder", "a sleeping child"]),
           ("lost", ["a glove", "the tickets", "a notebook", "his hat", "her keys"]),
           ("read", ["a newspaper", "a book about ships", "the instructions", "an old diary"])]
TIMES = ["On Monday", "In the morning", "Later that day", "At noon", "In the evening", "The next day",
         "On Saturday", "Before dawn", "After lunch", "At midnight"]
CITIES = ["Oslo", "Lisbon", "Nairobi", "Denver", "Kyoto", "Lima", "Cairo", "Dublin", "Perth", "Quebec",
          "Seoul", "Vienna", "Boston", "Madrid", "Hanoi", "Zurich", "Accra", "Austin", "Prague", "Tunis"]
CONDITIONS = ["clear skies", "light rain", "heavy rain", "snow", "fog", "strong wind", "scattered clouds",
              "thunderstorms", "sunshine"]
LISTS = [["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
         ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"],
         ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"],
         ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"],
         ["red", "orange", "yellow", "green", "blue", "indigo", "violet"],
         ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
         ["spring", "summer", "autumn", "winter"],
         ["A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P"]]

TOOLS = {
    "get_weather": {"description": "Current weather for a city.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                                   "required": ["city"]}},
    "get_time": {"description": "The local time in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                                "required": ["city"]}},
    "calculate": {"description": "Evaluate an arithmetic expression.",
                  "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "For example 12 * 7"}},
                                 "required": ["expression"]}},
    "define_word": {"description": "A dictionary definition of an English word.",
                    "parameters": {"type": "object", "properties": {"word": {"type": "string", "description": "The word"}},
                                   "required": ["word"]}},
}
DEFINITIONS = {"harbour": "a sheltered place on a coast where ships can stay", "ladder": "a set of steps between two long pieces of wood or metal",
               "orchard": "a piece of land planted with fruit trees", "lantern": "a lamp with a case that protects its flame",
               "meadow": "a field of grass and flowers", "anchor": "a heavy object that keeps a ship in place",
               "quill": "a pen made from a bird's feather", "glacier": "a slow river of ice",
               "compass": "an instrument that shows which way is north", "kettle": "a pot for boiling water"}


def tool_declare_text(names):
    """The body of the tool-declare system message: "# Tools" and the declared functions as JSON with
    the keys sorted (docs/kimi-k3.md section 4)."""
    tools = [{"function": {"description": TOOLS[n]["description"], "name": n, "parameters": TOOLS[n]["parameters"]},
              "type": "function"} for n in names]
    return "# Tools\n\n```json\n" + json.dumps(tools, sort_keys=True, ensure_ascii=False) + "\n```"


def pick(rng, *options):
    return rng.choice(options)


def story(rng):
    """A short story of 2-4 events and the facts it states: [(who, verb, what, where, when)]."""
    events, people = [], rng.sample(NAMES, 4)
    for i in range(rng.randint(2, 4)):
        verb, things = rng.choice(ACTIONS)
        events.append((people[i], verb, rng.choice(things), rng.choice(PLACES), rng.choice(TIMES)))
    sentences = []
    for who, verb, what, where, when in events:
        form = rng.random()
        if form < 0.4:
            s = f"{when}, {who} {verb} {what} {where}."
        elif form < 0.8:
            s = f"{who} {verb} {what} {where}."
        else:
            s = f"{when}, {what} was {verb} by {who} {where}."
        sentences.append(s[0].upper() + s[1:])
    return " ".join(sentences), events


def cap(s):
    return s[0].upper() + s[1:]


def passage_turn(rng, paragraphs, sentences_of):
    """(user text, reply) of one instruction over a passage."""
    kind = rng.random()
    if kind < 0.45:                                   # a generated story: who did what, where
        text, events = story(rng)
        who, verb, what, where, when = rng.choice(events)
        q = rng.random()
        if q < 0.3:
            question = pick(rng, f"Who {verb} {what}?", f"In the story, who {verb} {what}?", f"Tell me who {verb} {what}.")
            reply = pick(rng, f"{cap(who)} {verb} {what}.", f"It was {who}.", f"{cap(who)} did.")
        elif q < 0.6:
            question = pick(rng, f"What did {who} do?", f"What did {who} do in the story?")
            reply = f"{cap(who)} {verb} {what} {where}."
        elif q < 0.8:
            question = pick(rng, f"Where did {who} do it?", f"Where was {what} {verb}?")
            reply = pick(rng, f"{cap(where)}.", f"It happened {where}.")
        else:
            question = pick(rng, "Quote the first sentence.", "What is the first sentence, word for word?")
            reply = text.split(". ")[0].rstrip(".") + "."
        lead = pick(rng, "Read this story.", "Here is a short story.", "Story:", "Consider the following.", "")
        return (f"{lead} {text}\n\n{question}" if lead else f"{text}\n\n{question}"), reply
    if kind < 0.75:                                   # a corpus paragraph: quote from it
        for _ in range(20):
            sents = sentences_of(rng.choice(paragraphs))
            if 3 <= len(sents) <= 8 and sum(len(s) for s in sents) < 900:
                break
        else:
            return None
        text = " ".join(sents)
        q = rng.random()
        if q < 0.3:
            instr, reply = pick(rng, "Quote the first sentence of this passage.", "What is the first sentence of the passage?",
                                "Repeat the opening sentence."), sents[0]
        elif q < 0.55:
            instr, reply = pick(rng, "Quote the last sentence.", "What is the final sentence of this text?",
                                "Give me the passage's last sentence, word for word."), sents[-1]
        elif q < 0.75:
            k = rng.randrange(1, len(sents) - 1)
            ordinal = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"][k]
            instr, reply = f"What is the {ordinal} sentence?", sents[k]
        elif q < 0.9:
            instr = pick(rng, "How many sentences does this passage have?", "Count the sentences.")
            reply = pick(rng, f"It has {len(sents)} sentences.", f"{len(sents)} sentences.")
        else:
            instr, reply = pick(rng, "Repeat this passage exactly.", "Copy the text back to me."), text
        if rng.random() < 0.5:
            return f"{instr}\n\n{text}", reply
        return f"{text}\n\n{instr}", reply
    if kind < 0.9:                                    # continue a list
        items = rng.choice(LISTS)
        start = rng.randrange(0, len(items) - 3)
        shown = rng.randint(2, min(4, len(items) - start - 2))
        more = rng.randint(2, min(4, len(items) - start - shown))
        sep = pick(rng, ", ", ", ", "\n")
        given = sep.join(items[start:start + shown])
        rest = sep.join(items[start + shown:start + shown + more])
        instr = pick(rng, f"Continue this list with {more} more items:", f"Give the next {more}:",
                     f"What comes next? Name {more}.")
        return f"{instr}\n{given}", rest
    text, events = story(rng)                         # a question whose answer is not in the story
    who = rng.choice([n for n in NAMES if n not in [e[0] for e in events]])
    return (f"{text}\n\nWhat did {who} do?",
            pick(rng, f"The story does not mention {who}.", f"{cap(who)} is not in the story, so I can't say."))


SMALLTALK = [
    (["Hello!", "Hi there.", "Good morning!", "Hey, how's it going?", "Hello, who am I talking to?"],
     ["Hello! How can I help you today?", "Hi! What would you like to talk about?",
      "Good day! I am a small language model. Ask me something.", "Hello there. What can I do for you?"]),
    (["How are you?", "How are you doing today?", "Are you well?"],
     ["I am fine, thank you. How can I help?", "Doing well, thanks for asking. What do you need?",
      "Very well, thank you. And you?"]),
    (["Thank you!", "Thanks a lot.", "That was helpful, thanks."],
     ["You are welcome.", "Glad I could help.", "Any time. Is there anything else?"]),
    (["Who are you?", "What are you?", "What is your name?", "Tell me about yourself."],
     ["I am the little K3, a small language model with the architecture of Kimi K3.",
      "I am a small language model. I can read a passage and answer questions about it.",
      "My name is little K3. I am a tiny model, so I know little, but I can try."]),
    (["Goodbye.", "Bye for now!", "See you later.", "That's all for today."],
     ["Goodbye!", "Bye! Have a good day.", "See you soon.", "Take care."]),
    (["Can you help me?", "I have a question.", "Can I ask you something?"],
     ["Of course. What is your question?", "Yes, go ahead.", "Sure, ask away."]),
]

UNKNOWABLE = [
    ["What is the weather like today?", "Will it rain tomorrow?", "Is it cold outside right now?"],
    ["What time is it?", "What is today's date?", "What day of the week is it today?"],
    ["What is my name?", "Where do I live?", "How old am I?", "What did I have for breakfast?"],
    ["What will the price of gold be next week?", "Who will win the next election?", "Which stock should I buy tomorrow?"],
    ["What is my bank account number?", "What is the password to my email?", "What is my phone number?"],
]
REFUSALS = [
    ["I can't know that: I have no access to current information.", "I don't know. I have no way to look outside or check a forecast.",
     "I cannot tell. I have no live data about the weather."],
    ["I don't know: I have no clock or calendar.", "I can't tell the time; nothing here tells me the date.",
     "I have no way of knowing today's date."],
    ["You haven't told me, so I don't know.", "I don't know that. You would have to tell me.",
     "I have no information about you."],
    ["Nobody can know that in advance, and I certainly can't.", "I can't predict the future.",
     "I don't know. That has not happened yet."],
    ["I don't know it, and you should not share it with anyone.", "I have no access to your private information.",
     "I can't know that, and it is best kept private."],
]


def tool_turns(rng, r):
    """A conversation with declared tools: the declaration, the user's request, the call, the result,
    the answer. Appends to the renderer r."""
    declared = rng.sample(sorted(TOOLS), rng.choice([1, 1, 2]))
    r.message("system", tool_declare_text(declared), type="tool-declare")
    name = rng.choice(declared)
    if rng.random() < 0.15:                           # a question no declared tool serves
        user, reply = rng.choice([("Tell me a fun fact.", "Honey never spoils if it is kept sealed."),
                                  ("Say hello in French.", "Bonjour."),
                                  ("What is the capital of France?", "The capital of France is Paris.")])
        r.message("user", user)
        r.message("assistant", reply)
        return
    if name == "get_weather":
        city = rng.choice(CITIES)
        user = pick(rng, f"What's the weather in {city}?", f"Is it raining in {city} right now?",
                    f"How warm is it in {city} today?", f"Weather for {city}, please.")
        args = {"city": city}
        t, cond = rng.randint(-8, 34), rng.choice(CONDITIONS)
        result = json.dumps({"city": city, "conditions": cond, "temperature_c": t}, sort_keys=True)
        answer = pick(rng, f"In {city} it is {t} °C with {cond}.", f"It is {t} degrees in {city}, with {cond}.",
                      f"Right now {city} has {cond} and {t} °C.")
    elif name == "get_time":
        city = rng.choice(CITIES)
        user = pick(rng, f"What time is it in {city}?", f"Tell me the local time in {city}.", f"Is it late in {city}?")
        args = {"city": city}
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        result = json.dumps({"city": city, "time": f"{hh:02d}:{mm:02d}"}, sort_keys=True)
        answer = pick(rng, f"It is {hh:02d}:{mm:02d} in {city}.", f"The local time in {city} is {hh:02d}:{mm:02d}.")
    elif name == "calculate":
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        op, sym = rng.choice([("+", "plus"), ("-", "minus"), ("*", "times")])
        expr = f"{a} {op} {b}"
        user = pick(rng, f"What is {a} {sym} {b}?", f"Calculate {expr}.", f"Can you work out {expr} for me?")
        args = {"expression": expr}
        value = a + b if op == "+" else a - b if op == "-" else a * b
        result = json.dumps({"result": value})
        answer = pick(rng, f"{expr} = {value}.", f"The answer is {value}.", f"{a} {sym} {b} is {value}.")
    else:
        word = rng.choice(sorted(DEFINITIONS))
        user = pick(rng, f"What does the word {word} mean?", f"Define {word}.", f"Look up \"{word}\" for me.")
        args = {"word": word}
        result = json.dumps({"definition": DEFINITIONS[word], "word": word}, sort_keys=True)
        answer = pick(rng, f"A {word} is {DEFINITIONS[word]}.", f"{cap(word)}: {DEFINITIONS[word]}.")
    r.message("user", user)
    r.message("assistant", pick(rng, "", "", "Let me check.", "One moment."), tool_calls=[(name, args)])
    r.message("tool", result, tool=name, index=1)
    r.message("assistant", answer)


def chat_sample(rng, Renderer, paragraphs, sentences_of, kind=None):
    """One conversation as a segment list (Renderer(None).segments), and its kind."""
    r = Renderer(None)
    kind = kind or rng.choices(["passage", "smalltalk", "refusal", "tool", "continue"], [42, 12, 10, 20, 16])[0]
    think = kind != "tool" and rng.random() < 0.15    # `chat --think`: the effort message, think blocks
    if think:
        r.thinking_effort(rng.choice(["low", "medium", "high", "max"]))
    elif rng.random() < 0.15:
        r.message("system", pick(rng, "You are a helpful assistant.", "You are the little K3. Answer briefly.",
                                  "Be concise and friendly."))
    turns = 1 if kind == "tool" else rng.choice([1, 1, 1, 2])
    for _ in range(turns):
        if kind == "tool":
            tool_turns(rng, r)
            continue
        if kind == "passage":
            turn = passage_turn(rng, paragraphs, sentences_of)
            if turn is None:
                continue
            user, reply = turn
        elif kind == "smalltalk":
            us, rs = rng.choice(SMALLTALK)
            user, reply = rng.choice(us), rng.choice(rs)
        elif kind == "refusal":
            k = rng.randrange(len(UNKNOWABLE))
            user, reply = rng.choice(UNKNOWABLE[k]), rng.choice(REFUSALS[k])
        else:
            sents = sentences_of(rng.choice(paragraphs))
            if len(sents) < 2:
                continue
            user = pick(rng, "Continue this text: ", "Go on: ", "") + sents[0]
            reply = " ".join(sents[1:4])
        r.message("user", user)
        r.message("assistant", reply, think="" if think else None)
    return r.segments, kind


def copy_text(rng, paragraphs, words):
    """One plain-text passage whose second half is predictable only by copying from the first."""
    kind = rng.random()
    if kind < 0.45:
        p, q = rng.choice(paragraphs), rng.choice(paragraphs)
        if len(p) > 700:
            p = p[:700].rsplit(" ", 1)[0] + "."
        link = pick(rng, "\n", "\nAgain:\n", "\nOnce more: ", "\nI repeat: ")
        return p + "\n" + q[:rng.randint(0, 600)] + link + p
    if kind < 0.8:
        seq = " ".join(rng.choice(words) for _ in range(rng.randint(6, 30)))
        return "\n".join([seq] * rng.randint(2, 4))
    keys = rng.sample(words, rng.randint(3, 8))
    vals = [str(rng.randint(0, 999)) if rng.random() < 0.5 else rng.choice(words) for _ in keys]
    table = "\n".join(f"{k}: {v}" for k, v in zip(keys, vals))
    order = rng.sample(range(len(keys)), len(keys))
    return table + "\n\n" + "\n".join(f"{keys[i]}: {vals[i]}" for i in order)


def eval_chat_prompts(rng, Renderer, paragraphs, sentences_of, n=20):
    """n test conversations up to the assistant's turn (the last message is the user's), with what a
    good reply contains: {"kind", "segments", "expect" (a substring of a right answer, or None),
    "tool" (the tool to call, or None), "args"}. Built from held-out passages and a separate seed."""
    out = []
    kinds = ["passage"] * 6 + ["tool"] * 6 + ["smalltalk"] * 4 + ["refusal"] * 4
    for kind in kinds[:n]:
        r = Renderer(None)
        expect, tool, args = None, None, None
        if kind == "tool":
            inner = Renderer(None)
            tool_turns(rng, inner)
            segs, calls = inner.segments, inner.calls
            if not calls:                       # the no-tool branch: draw again
                inner = Renderer(None)
                while not inner.calls:
                    inner = Renderer(None)
                    tool_turns(rng, inner)
                segs, calls = inner.segments, inner.calls
            tool, args = calls[0]
            r.segments = segs[:inner.user_end[0]]   # declaration and the user's message
        elif kind == "passage":
            turn = None
            while turn is None or "story does not mention" in turn[1] or "not in the story" in turn[1]:
                turn = passage_turn(rng, paragraphs, sentences_of)
            r.message("user", turn[0])
            expect = turn[1].rstrip(".")[:40]
        elif kind == "smalltalk":
            us, _ = rng.choice(SMALLTALK)
            r.message("user", rng.choice(us))
        else:
            r.message("user", rng.choice(rng.choice(UNKNOWABLE)))
        r.generation_prompt()                   # thinking off, as `kimik3 chat` renders by default
        out.append({"kind": kind, "segments": r.segments, "expect": expect, "tool": tool, "args": args})
    return out
