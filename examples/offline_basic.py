"""Offline batch generation the way vLLM's basic example does it: only the import line and the
model path differ (a vLLM script moved over keeps working).

    python examples/offline_basic.py [MODEL_DIR]     # default: a tiny random Mixtral it builds
"""
import sys

from megainfer import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main(model: str):
    llm = LLM(model=model)
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Output:    {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        import tempfile

        from megainfer.tools.make_tiny import make_tiny
        path = make_tiny("mixtral", tempfile.mkdtemp(prefix="megainfer_tiny_"), seed=0)
    main(path)
