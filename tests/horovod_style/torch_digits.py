"""A Horovod PyTorch training script, written the way Horovod's PyTorch documentation shows.

The test (tests/test_drop_in.py) swaps only the import line below for pipesgd_hvd's.
"""
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

# Initialize Horovod
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(42)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
train_dataset = torch.utils.data.TensorDataset(x_train, y_train)

# Partition dataset among workers using DistributedSampler
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=32, sampler=train_sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

# Add Horovod Distributed Optimizer
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16)

# Broadcast parameters from rank 0 to all other processes.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


for epoch in range(20):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        test_accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: test accuracy {test_accuracy:.4f}", flush=True)

digests = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()])
print(f"RESULT rank={hvd.rank()} test_accuracy={test_accuracy:.4f} replicas_equal={digests[0] == digests[-1]}",
      flush=True)
