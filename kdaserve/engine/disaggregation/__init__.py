"""Prefill/decode disaggregation in the engine: SGLang's PD protocol for a KDA hybrid.

The PD router sends each request to a prefill and a decode server with the same
`bootstrap_room`. The decode side (`decode.py`) reserves the request's blocks and a state slot
first and sends the reservation (its Mooncake session, pool layout, block ids, slot) to the
prefill server's bootstrap endpoint (a ZeroMQ ROUTER, `prefill.py`); only then is the prompt
scheduled on the prefill side, so destination memory exists before any compute is spent.
After every forward the prefill side writes the request's newly complete blocks straight
from its pool into the decode side's reserved blocks (`mooncake.py`, no staging copy; the
spans from `layout.py`); after the last chunk it writes the tail block and every KDA layer's
recurrent and conv state, then sends the first sampled token ("done"). The decode side then
runs the request as a decode, with no forward over the prompt.

Failures free everything on both sides, and memory is never freed while the other side may
still write into it: a failed write (decode gone) fails the prefill request; the decode side
takes a prefill peer for dead only when a ping stays unanswered for `liveness_s`, and the
prefill side refuses to write for a peer silent for half that; a cancelled reservation is
held until the prefill side confirms (cancels are resent) or is dead. Messages are JSON,
checked field by field (never pickles from the network); every reply names the
reservation it answers.
"""

from __future__ import annotations

from kdaserve.engine.disaggregation.decode import DecodeSide
from kdaserve.engine.disaggregation.prefill import PrefillSide
from kdaserve.engine.disaggregation.side import SideHost

__all__ = ["DecodeSide", "PrefillSide", "SideHost", "make_side"]


def make_side(host: SideHost) -> PrefillSide | DecodeSide | None:
    mode = host.config.disaggregation_mode
    if mode is None:
        return None
    return PrefillSide(host) if mode == "prefill" else DecodeSide(host)
