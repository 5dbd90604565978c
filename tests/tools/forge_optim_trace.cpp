// forge_optim_trace IN.json OUT.json: runs forge's optimizer layer on a scripted problem
// so tests/python/test_optim_vs_torch.py can replay it in PyTorch.
//
// IN:  {"optimizer": {OptimizerConfig keys}, "lr_scheduler": {LRSchedulerConfig keys},
//       "total_steps": N, "max_norm": x,
//       "params": [{"shape": [...], "decay": bool, "values": [...]}, ...],
//       "grads": [[values of each param] for each optimizer step]}
// OUT: {"lrs": [lr_at(step) for step in 0..N), "norms": [pre-clip norm per step],
//       "params": [values...], "exp_avg": [values...], "exp_avg_sq": [values...]}
// Each optimizer step clips the grads, then takes an AdamW step with lr_at(step).
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "optim/config_rules.h"
#include "optim/optimizer.h"

namespace {

using nlohmann::json;

forge::Tensor tensor_from(const json& shape, const json& values) {
  forge::Tensor t = forge::Tensor::empty(shape.get<forge::Shape>());
  FORGE_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "{} values for shape {}", values.size(),
              forge::shape_str(t.shape()));
  float* p = t.data<float>();
  for (const json& v : values) *p++ = v.get<float>();
  return t;
}

json values_of(const std::vector<forge::Tensor>& tensors) {
  json out = json::array();
  for (const forge::Tensor& t : tensors) {
    const float* p = t.data<float>();
    out.push_back(std::vector<double>(p, p + t.numel()));
  }
  return out;
}

void run(const json& in, std::ostream& out_stream) {
  forge::OptimizerConfig opt;
  const json& o = in.at("optimizer");
  opt.lr = o.at("lr");
  opt.beta1 = o.at("beta1");
  opt.beta2 = o.at("beta2");
  opt.eps = o.at("eps");
  opt.weight_decay = o.at("weight_decay");
  forge::LRSchedulerConfig sched;
  const json& s = in.at("lr_scheduler");
  sched.warmup_steps = s.at("warmup_steps");
  sched.decay_style = s.at("decay_style");
  sched.decay_steps = s.at("decay_steps");
  sched.min_lr = s.at("min_lr");
  const int64_t total_steps = in.at("total_steps");
  const double max_norm = in.at("max_norm");
  forge::validate(opt, sched, total_steps);

  std::vector<forge::Tensor> params;
  std::vector<bool> decay;
  for (const json& p : in.at("params")) {
    params.push_back(tensor_from(p.at("shape"), p.at("values")));
    decay.push_back(p.at("decay").get<bool>());
  }
  forge::AdamW adamw(opt, params, decay);

  json norms = json::array();
  int64_t step = 0;
  for (const json& step_grads : in.at("grads")) {
    FORGE_CHECK(step_grads.size() == params.size(), "step {} has {} grads", step, step_grads.size());
    std::vector<forge::Tensor> grads;
    for (size_t i = 0; i < params.size(); ++i)
      grads.push_back(tensor_from(json(params[i].shape()), step_grads[i]));
    const double norm = forge::global_grad_norm(grads);
    norms.push_back(norm);
    adamw.step(grads, forge::lr_at(opt, sched, step, total_steps), forge::clip_coefficient(norm, max_norm));
    ++step;
  }

  json lrs = json::array();
  for (int64_t i = 0; i < total_steps; ++i) lrs.push_back(forge::lr_at(opt, sched, i, total_steps));

  json out = {{"lrs", lrs},
              {"norms", norms},
              {"params", values_of(params)},
              {"exp_avg", values_of(adamw.exp_avg())},
              {"exp_avg_sq", values_of(adamw.exp_avg_sq())}};
  out_stream << out.dump() << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: forge_optim_trace IN.json OUT.json\n";
    return 2;
  }
  try {
    std::ifstream in_stream(argv[1]);
    if (!in_stream) FORGE_FAIL("cannot open {}", argv[1]);
    json in = json::parse(in_stream);
    std::ofstream out_stream(argv[2]);
    if (!out_stream) FORGE_FAIL("cannot write {}", argv[2]);
    run(in, out_stream);
  } catch (const std::exception& e) {
    std::cerr << "forge_optim_trace: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
