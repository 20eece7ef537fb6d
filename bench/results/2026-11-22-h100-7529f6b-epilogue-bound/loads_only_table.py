import json,collections,sys,statistics as st
d=sys.argv[1]
R=collections.defaultdict(list)
def add(p,k,v,x): R[(p,k,v)].append(x)
for fn in ['fwd.txt','bwd.txt','wg.txt']:
  for l in open(d+'/'+fn):
    tag,v,js=l.split(' ',2)
    js=js.replace(':nan',':null').replace(':-nan',':null').replace(':inf',':null')
    try: j=json.loads(js)
    except: continue
    if tag=='fwd' and j.get('kind')=='tile':
      if j['ws']==1 and j['block_n']==256: add(j['preset'],'up_ws',v,j['up_ms']); add(j['preset'],'down_ws',v,j['down_ms'])
      if j['ws']==0 and j['pp']==0 and j['block_n']==256 and j['tma']==1 and j['group_m'][0]==16: add(j['preset'],'up_plain',v,j['up_ms']); add(j['preset'],'down_plain',v,j['down_ms'])
      if j['pp']==1 and j['mc']==0 and j['block_n']==256: add(j['preset'],'up_pp',v,j['up_ms'])
    if tag=='fwd' and j.get('kind')=='ceilings': add('all','cublas',v,j['cublas_bf16_tflops'])
    if tag=='bwd' and 'da_ms' in j:
      add(j['preset'],'dA',v,j['da_ms']); add(j['preset'],'dX',v,j['dx_ms'])
    if tag=='wg' and j.get('kind')=='wgrad' and j.get('impl')=='fused' and j['block_n']==256 and j['tma']==1:
      add(j['preset'],j['grad'],v,j['ms'])
# the service's sm90 GEMMs per preset (kAuto at 7529f6b): label -> bench key
svc={'sonic-7b':[('up','up_ws'),('down','down_ws'),('dA','dA'),('dXg','dX'),('dW2','dW2'),('dW13','dW13')],
     'qwen3-a3b':[('up','up_plain'),('down','down_plain'),('dA','dA'),('dXg','dX'),('dW2','dW2'),('dW13','dW13')],
     'scale-8k':[('up','up_pp'),('down','down_plain'),('dA','dA'),('dXg','dX'),('dW2','dW2'),('dW13','dW13')],
     'olmoe':[('up','up_plain'),('dA','dA'),('dW2','dW2')]}
N={'sonic-7b':(24576,1536,256,8),'qwen3-a3b':(16384,2048,768,8),'scale-8k':(8192,2048,1024,4),'olmoe':(16384,2048,1024,8)}
print('cublas TF/s', R[('all','cublas','base')])
for p,ks in svc.items():
  T,dm,h,K=N[p]; R_=T*K
  flop={'up':2*R_*dm*2*h,'down':2*R_*h*dm,'dA':2*R_*dm*h,'dXg':2*R_*2*h*dm,'dW2':2*R_*dm*h,'dW13':2*R_*dm*2*h}
  sb=sn=0
  print('|',p,'| GEMM | with epilogue ms (TF/s) | without ms (TF/s) | epilogue share |')
  for lab,k in ks:
    b=st.median(R[(p,k,'base')]); n=st.median(R[(p,k,'noepi')])
    sb+=b; sn+=n
    print('| | %s | %.3f (%.0f) | %.3f (%.0f) | %.0f%% |'%(lab,b,flop[lab]/b/1e9,n,flop[lab]/n/1e9,100*(1-n/b)))
  print('| | sum | %.3f | %.3f | %.0f%% (%.3f ms) |'%(sb,sn,100*(1-sn/sb),sb-sn))
