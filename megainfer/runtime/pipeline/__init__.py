"""One step across ranks: the attention side's ping-pong micro-batch pipeline, the expert
ranks' worker, the A2E/E2A exchange between them, and colocated mode's executor
(docs/architecture.md, "One hidden state's path across ranks")."""
from megainfer.runtime.pipeline.attention_executor import DisaggregatedExecutor
from megainfer.runtime.pipeline.colocated_executor import ColocatedExecutor
from megainfer.runtime.pipeline.exchange import (AttentionExchange, ExpertExchange, make_m2n,
                                                 rows_per_rank)
from megainfer.runtime.pipeline.expert_worker import ExpertWorker
from megainfer.runtime.pipeline.microbatch import split_by_tokens

__all__ = ["AttentionExchange", "ColocatedExecutor", "DisaggregatedExecutor", "ExpertExchange",
           "ExpertWorker", "make_m2n", "rows_per_rank", "split_by_tokens"]
