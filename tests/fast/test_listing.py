"""helpers/lessons/listing.py: the lessons show the lines of a worker that matter, with where they are."""
import pytest

from helpers import WORKERS
from helpers.lessons.listing import listing_text


def test_a_function_and_a_method_with_their_line_numbers():
    text = listing_text(WORKERS / "rpc_parameter_server.py", "ParameterServer.parameters", "train")
    lines = (WORKERS / "rpc_parameter_server.py").read_text().splitlines()
    first, second = text.split("\n\n# ")
    header, body = first.splitlines()[0], first.splitlines()[1:]
    start, end = (int(n) for n in header.split("lines ")[1].split(" of ")[0].split("-"))
    assert body[0] == "def parameters(self) -> list[torch.Tensor]:"  # the method, dedented
    assert [line.strip() for line in lines[start - 1:end]] == [line.strip() for line in body]
    assert second.startswith("rpc_parameter_server.py, lines ") and "\ndef train(" in second


def test_decorators_are_part_of_the_listing():
    text = listing_text(WORKERS / "rpc_batched_server.py", "BatchUpdateParameterServer.update_and_fetch_model")
    assert text.splitlines()[1] == "@staticmethod"


def test_a_name_that_is_not_there_is_an_error():
    with pytest.raises(ValueError, match="has no function or class 'nowhere'"):
        listing_text(WORKERS / "rpc_basics.py", "nowhere")
