from engine import Target, rewrite
from engine.blocks import CodeBlock, fenced_blocks, runnable_blocks


def test_tagged_blocks_in_order():
    text = (
        "First:\n```python\nprint(1)\n```\nthen\n~~~bash\nls /mnt/data\n~~~\n"
        "```js\nconsole.log(1)\n```\n```\nuntagged\n```\n"
    )
    assert runnable_blocks(text) == [CodeBlock("python", "print(1)\n"), CodeBlock("bash", "ls /mnt/data\n")]


def test_longer_fence_contains_shorter_one():
    text = "````py\nprint('```')\n```\nstill code\n````\n"
    assert runnable_blocks(text) == [CodeBlock("python", "print('```')\n```\nstill code\n")]


def test_unterminated_block_runs_to_end_and_empty_blocks_are_skipped():
    assert runnable_blocks("```sh\n\n```\n```python {.x}\nx = 1") == [CodeBlock("python", "x = 1\n")]


def test_indentation_and_closing_rules():
    # Up to three spaces before an opening fence; four make an indented code block, which is not run.
    assert runnable_blocks("   ```python\nprint(1)\n   ```\n") == [CodeBlock("python", "print(1)\n")]
    assert runnable_blocks("    ```python\nprint(1)\n    ```\n") == []
    # A closing fence: the same mark, at least as long, alone on its line (any indentation, spaces after).
    text = "```python\nx = '''\n~~~\n``\n```not closed\n'''\n      `````  \nafter\n"
    assert runnable_blocks(text) == [CodeBlock("python", "x = '''\n~~~\n``\n```not closed\n'''\n")]


def test_info_strings():
    # A backtick fence's info string cannot hold a backtick (it is inline code); a tilde fence's can.
    assert runnable_blocks("```py`x\nprint(1)\n```\n") == []
    assert runnable_blocks("~~~python `x`\nprint(1)\n~~~\n") == [CodeBlock("python", "print(1)\n")]
    assert runnable_blocks("```  PY   extra words\nprint(1)\n```") == [CodeBlock("python", "print(1)\n")]


def test_windows_line_ends():
    assert runnable_blocks("```python\r\nprint(1)\r\nprint(2)\r\n```\r\n") == [
        CodeBlock("python", "print(1)\nprint(2)\n")
    ]


def test_the_rewriter_reads_the_same_blocks_as_code():
    # One parser: what runs as code is exactly what the link rewriter leaves as written.
    body = "open('/mnt/data/x.csv')\n"
    text = (
        f"See /mnt/data/x.csv\n```python\n{body}```\n"
        f"   ~~~~bash\n{body}~~~\n~~~~\nthen /mnt/data/x.csv\n"
        f"````py\n```\n{body}```\n````\n"
        f"```py`x /mnt/data/x.csv```\n"  # inline code, not a block
        f"```sh\n{body}"  # unclosed: code to the end
    )
    target = Target(url="/cache/T/x.csv", name="x.csv")
    out = rewrite(text, {"x.csv": target})
    # (`~~~` does not close a `~~~~` block: it is the block's)
    assert [block.code for block in runnable_blocks(text)] == [
        body,
        body + "~~~\n",
        f"```\n{body}```\n",
        body,
    ]
    for _fence, start, end in fenced_blocks(text):
        assert text[start:end] in out
    assert out.count(target.url) == 2  # the two prose mentions, nothing in code
