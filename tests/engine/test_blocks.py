from engine.blocks import CodeBlock, runnable_blocks


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
