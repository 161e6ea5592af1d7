"""The demo runs through kvshare's own loader on any supported local folder."""

from kvshare.demo import run_demo


def test_demo_on_a_tiny_local_model(tiny_models, capsys):
    answer = run_demo(model=str(tiny_models("qwen3")), prompt="What is 12 plus 30?",
                      max_new_tokens=6)
    out = capsys.readouterr().out
    assert out.startswith("user: What is 12 plus 30?")
    assert f"assistant: {answer}" in out
