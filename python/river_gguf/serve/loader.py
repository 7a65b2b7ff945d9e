"""Which model class serves, and the name it is served under."""
import os


def model_class():
    """The class `river-gguf serve` loads: the llama_cpp-compatible Llama, so grammar,
    response_format, tools and llama-cpp-python's sampling parameters work as on its server. The
    server needs only what protocol.ServedModel names, and refuses (400) parameters the class
    does not take."""
    from ..llama import Llama

    return Llama


def load_model(args):
    """The model for `river-gguf serve`'s arguments."""
    from ..cli import default_model_for_cli, rpc_model_kwargs

    path = args.model or default_model_for_cli()
    river = dict(mode=args.mode, threshold=args.threshold, preset=args.preset, tail=args.tail)
    return model_class()(path, river=args.river, n_ctx=args.ctx, n_threads=args.threads,
                         n_gpu_layers=args.ngl, verbose=args.verbose, **river, **rpc_model_kwargs(args))


def model_id(model, alias=None) -> str:
    """--alias if given, else the model's file name (clients see this in /v1/models)."""
    return alias or os.path.basename(model.model_path)
