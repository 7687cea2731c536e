"""The source article's "quick tutorial: multi-GPU training with DDP", as printed (it breaks).

    python helpers/workers/ddp_article_original.py      # NameError: name 'os' is not defined

Steps 2 to 5 of the article, joined into one file with the indentation restored (the page lost it); we added only the
step headers, the "(missing ...)" comments and the noqa markers. Left as printed, on purpose: `os` and `optim` are used
but never imported, the port is fixed, the backend is nccl, `.to(rank)` assumes one GPU per rank and mp.spawn starts 4
processes. Lesson 02 runs it stage by stage with helpers/workers/ddp_article_run.py; the fixed version is
helpers/workers/ddp_train.py.
"""
# ruff: noqa: F401, UP008, B007  (the article as printed, not our style)
# Step 2: initialise the DDP environment
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (missing here: import os)


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'  # noqa: F821
    os.environ['MASTER_PORT'] = '12355'  # noqa: F821
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


# Step 3: define the model
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


class SimpleModel(nn.Module):
    def __init__(self):
        super(SimpleModel, self).__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(28*28, 10)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 10)

    def forward(self, x):
        x = self.flatten(x)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        x = self.relu(x)
        x = self.fc3(x)
        return x


def create_model():
    return SimpleModel()


# Step 4: the data loader
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402
from torchvision import datasets, transforms  # noqa: E402


def create_dataloader(rank, world_size, batch_size=32):
    transform = transforms.Compose([transforms.ToTensor()])
    dataset = datasets.MNIST(root='./data', train=True, download=True, transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    dataloader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return dataloader


# Step 5: the training loop
# (missing: import torch.optim as optim)
def train(rank, world_size, epochs=5):
    setup(rank, world_size)
    dataloader = create_dataloader(rank, world_size)
    model = create_model().to(rank)
    ddp_model = DDP(model, device_ids=[rank])
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)  # noqa: F821
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        ddp_model.train()
        for batch_idx, (data, target) in enumerate(dataloader):
            data, target = data.to(rank), target.to(rank)
            optimizer.zero_grad()
            output = ddp_model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"Epoch {epoch} complete")
    cleanup()


def main():
    world_size = 4  # Number of GPUs
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
