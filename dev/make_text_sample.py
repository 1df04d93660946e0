"""Rebuild qgemv/data/enwiki_{calib,eval}.txt from the gensim 4.4.0 wheel.

Source: gensim's test file enwiki-latest-pages-articles1.xml-p000000010p000030302
-shortened.bz2 (106 English Wikipedia articles, CC BY-SA 4.0).  Markup is
stripped with a few regular expressions; redirects are dropped.  Articles are
split by position (even -> calibration, odd -> evaluation), so the two texts
share no article.  Sizes are capped to keep the repository small.

    pip download --no-deps gensim==4.4.0 -d /tmp/dl
    python dev/make_text_sample.py /tmp/dl/gensim-4.4.0-*.whl

``--calib-all PATH`` instead writes every calibration-side (even) article,
uncapped, to PATH: about three times the embedded calibration text, still
disjoint from the evaluation split, for runs that need more calibration
windows (``python -m qgemv.calibration.e2e ... --calib PATH``).
"""

import bz2
import re
import zipfile
from pathlib import Path

MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
OUT = Path(__file__).resolve().parent.parent / "qgemv" / "data"
CAPS = {"calib": 420_000, "eval": 420_000}  # characters


def strip_nested(text: str, open_s: str, close_s: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_s, i):
            depth += 1
            i += len(open_s)
        elif depth and text.startswith(close_s, i):
            depth -= 1
            i += len(close_s)
        else:
            if depth == 0:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean(wiki: str) -> str:
    import html

    t = html.unescape(wiki)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>]*/>", "", t)
    t = re.sub(r"<ref.*?</ref>", "", t, flags=re.S)
    t = strip_nested(t, "{{", "}}")
    t = strip_nested(t, "{|", "|}")
    t = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"\[\[([^|\]]*)\|([^\]]*)\]\]", r"\2", t)
    t = re.sub(r"\[\[([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://[^ \]]+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://[^\]]*\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    t = re.sub(r"\n{3,}", "\n\n", t)
    return t.strip()


def main(wheel: str, calib_all: str = "") -> None:
    raw = bz2.decompress(zipfile.ZipFile(wheel).read(MEMBER)).decode("utf-8")
    articles = []
    for page in re.findall(r"<page>(.*?)</page>", raw, re.S):
        title = re.search(r"<title>(.*?)</title>", page).group(1)
        m = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
        if not m or m.group(1).lstrip().upper().startswith("#REDIRECT"):
            continue
        body = clean(m.group(1))
        if len(body) > 2000:
            articles.append(f"{title}\n\n{body}")
    sides = {"calib": articles[0::2], "eval": articles[1::2]}  # even / odd articles: no article in both
    if calib_all:
        text = "\n\n".join(sides["calib"])
        Path(calib_all).write_text(text + "\n", encoding="utf-8")
        print(f"calib (all even articles): {len(sides['calib'])} articles, {len(text)} characters -> {calib_all}")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    for name, side in sides.items():
        chosen, size = [], 0
        for a in side:
            if size < CAPS[name]:
                chosen.append(a)
                size += len(a)
        text = "\n\n".join(chosen)[: CAPS[name]]
        (OUT / f"enwiki_{name}.txt").write_text(text + "\n", encoding="utf-8")
        print(f"{name}: {len(chosen)} articles, {len(text)} characters")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="rebuild the embedded Wikipedia text from the gensim wheel")
    ap.add_argument("wheel")
    ap.add_argument("--calib-all", default="", help="write all calibration-side articles (uncapped) to this file")
    a = ap.parse_args()
    main(a.wheel, a.calib_all)
