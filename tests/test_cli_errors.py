"""What a user sees for a mistyped run.toml or --peers address, and the plain round log of a node without a
terminal (issue 29)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hetero_node.client.cli.progress import RoundLog
from hetero_node.client.node.run_definition import load_run_file
from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.client.swarm.addresses import parse_peer_multiaddrs
from hetero_node.protocol.errors import ConfigError, PeerAddressError

PEER_ID = "QmRn24WFzfXyfBffZYEyQFiwoAwZdQXX61HnGwmvTJbtSr"


def run_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[outer]\ninner_steps = "thirty"\n', "[outer] inner_steps = 'thirty': input should be a valid integer"),
        ("[optim]\nlr = true\n", "[optim] lr = True: input should be a valid number"),
        ("[run]\npreset = 7\n", "[run] preset = 7: input should be a valid string"),
        ('[run]\ndata = ["a.txt"]\n', "[run] data = ['a.txt']: input should be a valid string"),
    ],
)
def test_a_run_file_value_of_the_wrong_type_names_its_key_and_the_type_expected(
    tmp_path: Path, text: str, named: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_run_file(run_file(tmp_path, text))
    assert str(raised.value) == f"--config {tmp_path / 'run.toml'}: {named}"


def test_a_run_file_of_the_right_types_loads_as_written(tmp_path: Path) -> None:
    """An integer where a float belongs is a number all the same; file options are strings."""
    text = '[run]\npreset = "tiny"\ndata = "corpus.txt"\nseed = 3\n[optim]\nlr = 1\n[outer]\ninner_steps = 30\n'
    loaded = load_run_file(run_file(tmp_path, text))
    assert loaded == {"run": {"preset": "tiny", "data": "corpus.txt", "seed": 3}, "optim": {"lr": 1},
                      "outer": {"inner_steps": 30}}  # fmt: skip


def test_a_peer_address_without_its_peer_id_says_the_p2p_part_is_missing() -> None:
    with pytest.raises(PeerAddressError, match=r"lacks the /p2p/<peer id> part .* like /ip4/.*/p2p/Qm"):
        parse_peer_multiaddrs(["/ip4/127.0.0.1/tcp/31999"])
    with pytest.raises(PeerAddressError, match=r"'foo' is not a peer multiaddr like /ip4/1\.2\.3\.4/tcp/31337/p2p/Qm"):
        parse_peer_multiaddrs(["foo"])
    full = f"/ip4/127.0.0.1/tcp/31999/p2p/{PEER_ID}"
    assert parse_peer_multiaddrs([full]) == [full]


def record(round_: int, loss: float | None, contributed: bool, caught_up: str = "") -> RoundRecord:
    return RoundRecord(
        round=round_, inner_steps=4, tokens=2048, train_loss=loss, eval_loss=None, bytes_sent=1500,
        bytes_received=2500, compute_s=1.25, comm_s=0.5, fingerprints={}, contributors=2 if contributed else 1,
        contributed=contributed, caught_up=caught_up,
    )  # fmt: skip


def test_the_round_log_writes_one_line_per_round_and_a_summary_even_at_the_default_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logging.getLogger().setLevel(logging.WARNING)  # the CLI's default --log-level
    caplog.handler.setLevel(logging.NOTSET)
    log = RoundLog()
    log(record(3, 4.25, contributed=True))
    log(record(4, None, contributed=False, caught_up="state"))
    log.summary()
    lines = [r.getMessage() for r in caplog.records if r.name == "hetero_node.rounds"]
    assert lines == [
        "round 3: 4 steps, loss 4.250, 2 contributors, 1,500 bytes sent, 2,500 received, 1.8 s",
        "round 4: 4 steps, loss -, 1 contributors (caught up from state), 1,500 bytes sent, 2,500 received, 1.8 s",
        "left the swarm after 2 rounds (1 contributed): 8 steps, last loss 4.250, 3,000 bytes sent, 5,000 received",
    ]
