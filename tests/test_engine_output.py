"""Stop strings across token boundaries; held-back text is never emitted."""

from mlxfast.engine.output import OutputProcessor


class Tok:
    def __init__(self, pieces):
        self.pieces = pieces

    def detokenizer(self, skip_special_tokens=False):
        pieces = self.pieces

        class D:
            def add(self, t):
                return pieces[t]

            def flush(self):
                return ""

            def hides(self, t):
                return False

        return D()


def run(pieces, stop, ids):
    out = OutputProcessor(Tok(pieces), stop)
    emitted = []
    for t in ids:
        emitted.append(out.add(t))
        if out.stop_string:
            break
    return emitted, out.finish(), out.stop_string


def test_stop_across_tokens_is_held_back_and_cut():
    pieces = ["Hel", "lo ", "wo", "rld", "!"]
    emitted, rest, stop = run(pieces, ["o wor"], [0, 1, 2, 3, 4])
    assert "".join(emitted) + rest == "Hell" and stop == "o wor"
    assert emitted == ["Hel", "l", "", "", ][:len(emitted)] or "".join(emitted) == "Hell"


def test_no_stop_releases_everything():
    pieces = ["a", "b", "c"]
    emitted, rest, stop = run(pieces, ["bd"], [0, 1, 2])
    assert emitted == ["a", "", "bc"] and rest == "" and stop is None
    emitted, rest, stop = run(pieces, ["cd"], [0, 1, 2])
    assert "".join(emitted) == "ab" and rest == "c" and stop is None


def test_earliest_stop_wins():
    pieces = ["xxABCDyy"]
    emitted, rest, stop = run(pieces, ["CD", "AB"], [0])
    assert emitted == ["xx"] and stop == "AB" and rest == ""


def run_with(pieces, stop, ids, **kw):
    out = OutputProcessor(Tok(pieces), stop, **kw)
    emitted = []
    for t in ids:
        emitted.append(out.add(t))
        if out.stop_string:
            break
    return "".join(emitted) + out.finish(), out.stop_string


def test_min_tokens_lets_stop_strings_match_only_after_it():
    pieces = ["a.", "b.", "c.", "d"]
    assert run_with(pieces, ["."], [0, 1, 2, 3]) == ("a", ".")
    assert run_with(pieces, ["."], [0, 1, 2, 3], min_tokens=2) == ("a.b.c", ".")
    assert run_with(pieces, ["."], [0, 1, 2, 3], min_tokens=4) == ("a.b.c.d", None)


def test_include_stop_str_in_output_ends_the_text_with_it():
    pieces = ["Hel", "lo ", "wo", "rld", "!"]
    assert run_with(pieces, ["o wor"], [0, 1, 2, 3, 4], include_stop=True) == ("Hello wor", "o wor")
    assert run_with(pieces, ["!", "wo"], [0, 1, 2, 3, 4], include_stop=True) == ("Hello wo", "wo")


def test_a_stop_string_across_the_min_tokens_boundary_counts():
    """vLLM's rule: after min_tokens, a stop string that began in the text
    before the boundary and ends after it matches; one wholly before does not."""
    pieces = ["a\n", "\nb", "c", "\n\nd"]
    assert run_with(pieces, ["\n\n"], [0, 1, 2, 3], min_tokens=1) == ("a", "\n\n")
    assert run_with(pieces, ["\n\n"], [0, 1, 2, 3], min_tokens=2) == ("a\n\nbc", "\n\n")
    assert run_with(["xx", "y", "xx"], ["xx"], [0, 1, 2], min_tokens=1) == ("xxy", "xx")
